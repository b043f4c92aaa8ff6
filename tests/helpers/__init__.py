"""Test helpers: launch.py (accelerate launch of a recipe), dist.py (in-process gloo ranks), parity.py (the
contract's tolerances and assertions), results.py (figures written to benchmarks/results)."""
