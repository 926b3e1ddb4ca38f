"""End to end: the main job and the framework examples launched as users run them, the HuggingFace example, the
benchmarks' timeline helper, and the package built and installed."""
