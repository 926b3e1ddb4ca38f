"""Tests of mfsdp_ext/params/."""
