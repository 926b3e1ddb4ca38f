"""Tests of mfsdp_ext/interop/."""
