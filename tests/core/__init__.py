"""Tests of mfsdp_ext/core/."""
