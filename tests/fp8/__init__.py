"""Tests of mfsdp_ext/fp8/."""
