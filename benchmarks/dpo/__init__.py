"""DPO: speed against TRL (speed.py, profile.py, cudnn_diag.py; the shared case: trl_compare.py), length under CP
(cp_length.py)."""
