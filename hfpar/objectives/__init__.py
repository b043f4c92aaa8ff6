"""What the training loop optimizes: one Objective interface (base.py: every hook the trainer calls, with the
token-normalized LM / classification loss as its default), the preference objective (preference.py: DPO) and the
reference model it owns (reference.py).
"""
