"""Shared by the benchmarks: the launcher (launch.py) and the saved-tensor byte counter (activation_bytes.py)."""
