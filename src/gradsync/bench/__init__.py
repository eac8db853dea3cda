"""Benchmarks: programs that print tables and write JSON (not timed unit tests)."""
