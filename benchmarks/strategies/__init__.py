"""Data-parallel strategies: throughput (speed.py), loss curves (loss_curves.py), bytes communicated
(communication.py)."""
