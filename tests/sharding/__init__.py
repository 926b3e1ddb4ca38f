"""Tests of mfsdp_ext/sharding/."""
