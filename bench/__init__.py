"""Benchmarks for the LingBot-Video pack (run as modules, e.g. ``python -m bench.offload``)."""
