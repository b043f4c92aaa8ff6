"""FSDP2 over the data-parallel group of a tensor-parallel model (2-D: dp x tp).

    model = apply_tensor_parallel(model, tp_group)
    model = fully_shard_dp(model, dp_group)            # each TP shard further sharded over dp
    norm = clip_grad_norm_2d_(model, max_norm, tp_group, dp_group)
    state = full_state_dict_2d(model)                  # collective: HF names, full tensors

Why by hand: Accelerate's FSDP2 path shards over the whole world (one mesh), which would mix
different TP shards; here `fully_shard` gets a 1-D mesh built from the dp group, so parameters
are DTensors sharded over dp only, and every TP rank of a replica holds its own TP shard of them.
FSDP2 replaces the Parameter objects, so hfpar's TP / SP markers (`_hfpar_tp`, `_hfpar_sp`) are
carried over to the new DTensor parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hfpar.parallel.tensor import gather_shards

_MARKERS = ("_hfpar_tp", "_hfpar_sp")


def fully_shard_dp(model: nn.Module, dp_group, *, reshard_after_forward: bool = True,
                   ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """ignored_params: left out of FSDP (expert-parallel experts: sharded by EP already, reduced by hfpar
    over the ranks that hold the same experts)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(dp_group, device_type=device_type)
    markers = {n: {m: getattr(p, m) for m in _MARKERS if hasattr(p, m)} for n, p in model.named_parameters()}
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():  # one FSDP unit per decoder layer, as the fsdp2 config does
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)
    for n, p in model.named_parameters():
        for key, value in markers.get(n, {}).items():
            setattr(p, key, value)
    return model


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def scale_grads_to_norm_(params, total_norm: torch.Tensor, max_norm: float) -> None:
    """Clip by a global norm computed elsewhere: grads *= min(1, max_norm / (norm + 1e-6)), the rule of
    torch.nn.utils.clip_grads_with_norm_, applied to each rank's local shards (torch's version would mix
    FSDP2's DTensor grads with the plain-tensor norm). No host sync: a factor of 1 leaves grads unchanged."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in params:
        g = local_tensor(p.grad)
        g.mul_(coef.to(g.dtype))


def sync_sp_grads_2d(model: nn.Module, tp_group) -> None:
    """Sum over the TP group the grads of SP-replicated params (norms); local dp shards line up."""
    for p in model.parameters():
        if getattr(p, "_hfpar_sp", None) is not None and p.grad is not None:
            dist.all_reduce(local_tensor(p.grad), group=tp_group)


def clip_grad_norm_2d_(model: nn.Module, max_norm: float, tp_group, dp_group) -> torch.Tensor:
    """Global L2 norm: local shard squares summed over dp (FSDP shards), TP-sharded params also over tp,
    TP-replicated params counted once. Scales the grads in place when the norm exceeds max_norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    dev = local_tensor(params[0].grad).device
    sq = torch.zeros(2, dtype=torch.float64, device=dev)  # [tp-sharded, tp-replicated]
    for p in params:
        sq[0 if getattr(p, "_hfpar_tp", None) is not None else 1] += local_tensor(p.grad).double().square().sum()
    dist.all_reduce(sq, group=dp_group)
    tp_part = sq[0:1].clone()
    dist.all_reduce(tp_part, group=tp_group)
    total = (tp_part[0] + sq[1]).sqrt()
    scale_grads_to_norm_(params, total, max_norm)
    return total


def full_state_dict_2d(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over the whole world: all-gather each parameter over dp, then its TP shards over tp."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach()
    for name, p in model.named_parameters():
        meta = getattr(p, "_hfpar_tp", None)
        if meta is not None:
            out[name] = gather_shards(out[name], meta["dim"], meta["group"], meta.get("packed_splits"))
    return out


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
        local_tensor(live).copy_(saved)
        return live
    if isinstance(live, dict):
        return {k: load_local_state(live[k], saved[k]) if k in live else saved[k] for k in saved}
    if isinstance(live, list):
        return [load_local_state(a, b) for a, b in zip(live, saved)]
    return saved


def load_optimizer_2d(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load per-rank local optimizer state: param-shaped tensors become DTensors like their params."""
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
