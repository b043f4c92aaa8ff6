"""Tensor parallelism: activation memory with / without SP (activation_memory.py), the family sweep
(family_sweep.py) and the docs section it feeds (families_doc.py)."""
