"""Pipeline parallelism: bubble, activation memory, p2p bytes and tokens/s per schedule (schedules.py)."""
