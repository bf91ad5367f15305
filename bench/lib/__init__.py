"""Helpers the benchmarks share: their working folder, their console, the synthetic pools."""
