"""Test helpers: launch.py (accelerate launch of a recipe), dist.py (in-process gloo ranks), parity.py (the
contract's tolerances and assertions), results.py (figures written to benchmarks/results/<topic>/).
The launch command and environment come from benchmarks/common/launch.py (the one launcher, shared with the
benchmarks); the TRL DPO case and the TP / EP family sweeps, which tests run a subset of, live in benchmarks/."""
