"""Tests of mfsdp_ext/comm/."""
