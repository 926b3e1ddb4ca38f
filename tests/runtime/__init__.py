"""Tests of mfsdp_ext/runtime/."""
