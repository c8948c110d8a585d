"""Benchmark harness: times mate_cupy ops beside their peers (see bench/README.md)."""
