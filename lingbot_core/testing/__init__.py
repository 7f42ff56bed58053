"""Tiny random-weight packages in the released layout, and GGUF files of them: for tests, the demo and benchmarks.

Imports lingbot_core.files and lingbot_core.model; the product never imports this wing.
"""
