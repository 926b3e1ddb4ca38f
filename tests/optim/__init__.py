"""Tests of mfsdp_ext/optim/."""
