"""The test suite's own costs: one launch (launch_cost.py)."""
