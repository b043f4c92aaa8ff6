"""MoE: block speed (block_speed.py, gpu.py, ep_cpu.py; shapes.py), the EP sweep over every MoE family
(ep_family_sweep.py)."""
