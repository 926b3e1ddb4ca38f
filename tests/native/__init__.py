"""Tests of mfsdp_ext/_native/: the native extension's kernels against torch."""
