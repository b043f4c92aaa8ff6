"""Per-rank tensors of a checkpoint (the backends' save_rank_state / load_rank_state hooks use these).

    torch.save({"model": local_state(model.state_dict())}, rank_state_file(ckpt_dir, ctx))
    load_local_state(model.state_dict(), saved["model"]); load_optimizer_state(optimizer, saved["optimizer"])
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_state(obj) -> object:
    """A (nested) state dict with every DTensor replaced by its local shard (torch.save-able per rank)."""
    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj


def load_local_state(live, saved):
    """Copy saved local shards into the live (possibly DTensor) tensors of a state dict, in place."""
    if isinstance(live, torch.Tensor):
        (live.to_local() if isinstance(live, DTensor) else live).copy_(saved)
        return live
    if isinstance(live, dict):
        return {k: load_local_state(live[k], saved[k]) if k in live else saved[k] for k in saved}
    if isinstance(live, list):
        return [load_local_state(a, b) for a, b in zip(live, saved)]
    return saved


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load per-rank local optimizer state: param-shaped tensors become DTensors like their params (FSDP2)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, st in saved["state"].items():
        p = params[int(idx)]
        new = {}
        for k, v in st.items():
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 and v.shape == p.to_local().shape:
                v = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False)
            new[k] = v
        state[idx] = new
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
