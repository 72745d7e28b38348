"""Benchmarks of `offload` (run as scripts: ``python benchmarks/<name>.py``; see README.md)."""
