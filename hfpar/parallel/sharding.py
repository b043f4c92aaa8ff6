"""One sharding record per parameter (ShardSpec), and what is written once on top of it.

    spec = shard_spec(param)                 # None: an ordinary data-parallel (replicated) parameter
    sync_partial_grads(model.parameters())   # after backward: SP norms, q/k norms under TP (sum over tp)
    reduce_dp_grads(model.parameters())      # experts: sum over the ranks holding the same experts / dp
    norm = clip_grads_(model.parameters(), max_norm)   # the ONE global grad norm of every composition
    full = full_state_dict(model)            # collective: full tensors under the HF names (export)

A ShardSpec says how a parameter differs from the one-process parameter:
    group, dim, size, packed_splits   this rank holds 1/size of it along `dim` over `group` (TP: its rows /
                                      columns of every packed part; EP: its experts, dim 0)
    partial_grad_group                the parameter is replicated, but each rank's grad covers only part of
                                      the data (sequence-parallel norms; q/k norms applied to local heads):
                                      the full grad is the SUM over this group
    dp_reduce_group, dp_size          the backend does not reduce this grad (the ranks of the backend's dp
                                      group hold different experts): SUM over this group, divide by dp_size
FSDP2 shards on top of this as DTensors over the dp mesh; the grad norm and the full state dict read
that from the DTensor placements, so one implementation covers plain, DTensor and DeepSpeed-held grads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .comm import all_gather, all_reduce, group_size

__all__ = [
    "ShardSpec",
    "shard_spec",
    "set_shard_spec",
    "carry_shard_specs",
    "shard_tensor",
    "gather_shards",
    "unpack_parts",
    "local_tensor",
    "grad_sq_norm",
    "grad_norm",
    "scale_grads_to_norm_",
    "clip_grads_",
    "sync_partial_grads",
    "partial_grad_hooks",
    "reduce_dp_grads",
    "full_state_dict",
    "unique_params",
]

_ATTR = "_hfpar_shard"


@dataclass(eq=False)
class ShardSpec:
    kind: str = "replicated"  # "tp" | "ep" | "replicated" (for messages and filters)
    group: object = None  # process group the parameter is sharded over
    dim: int = 0
    size: int = 1
    packed_splits: list[int] | None = None
    partial_grad_group: object = None
    dp_reduce_group: object = None
    dp_size: int = 1
    experts: dict | None = None  # EP: {"num_experts": E, "start": first local expert}

    @property
    def extra(self) -> dict | None:
        """The name of `experts` before issue 38 (read-only; "extra" now means run_info.json's added fields only)."""
        return self.experts

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def dp_by_hfpar(self) -> bool:
        """hfpar, not the data-parallel backend, reduces this grad (the backend's ranks hold different ones)."""
        return self.dp_reduce_group is not None or self.dp_size > 1

    def __reduce__(self):  # process groups do not pickle (torch.save(param)): they come back as None
        return (_rebuild, ({**self.__dict__, "group": None, "partial_grad_group": None, "dp_reduce_group": None},))


def _rebuild(fields: dict) -> ShardSpec:
    return ShardSpec(**{("experts" if k == "extra" else k): v for k, v in fields.items()})  # "extra": pickled before


def shard_spec(t: torch.Tensor) -> ShardSpec | None:
    return getattr(t, _ATTR, None)


def set_shard_spec(param: torch.Tensor, spec: ShardSpec | None = None, **updates) -> torch.Tensor:
    """Attach (or update fields of) a parameter's ShardSpec; returns the parameter."""
    spec = replace(spec or shard_spec(param) or ShardSpec(), **updates)
    setattr(param, _ATTR, spec)
    # Megatron's / DeepSpeed's tag for the same fact: ZeRO's grad norm sums such a shard over the mpu's TP group
    param.tensor_model_parallel = spec.kind == "tp" and spec.sharded
    return param


def carry_shard_specs(model: nn.Module, specs: dict[str, ShardSpec]) -> None:
    """Put specs (by parameter name) back on a model whose Parameter objects a wrapper replaced (FSDP2)."""
    for name, p in model.named_parameters():
        if name in specs:
            set_shard_spec(p, specs[name])


def tensor_names(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """id -> (tensor, every state-dict name of it): tied parameters are one entry with both names, in state-dict order
    (a LM head tied to the embedding: the embedding's name first)."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out.setdefault(id(t), (t, []))[1].append(name)
    return out


def unique_params(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


# ----------------------------------------------------------------------------- split / join
def _part_sizes(total: int, packed_splits: Sequence[int] | None) -> list[int]:
    return [total] if packed_splits is None else [int(s) for s in packed_splits]


def shard_tensor(
    full: torch.Tensor, dim: int, rank: int, size: int, packed_splits: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's shard along `dim`; with packed_splits, its slice of EACH part, concatenated.
    E.g. fused qkv (q+k+v, H) with packed_splits=[q, k, v] -> (q/tp + k/tp + v/tp, H). A fresh tensor."""
    sizes = _part_sizes(full.shape[dim], packed_splits)
    if full.is_meta:  # any op on meta tensors imports torch's meta kernels (~3 s): build it directly
        shape = list(full.shape)
        shape[dim] = sum(s // size for s in sizes)
        return torch.empty(shape, dtype=full.dtype, device="meta")
    parts = full.split(sizes, dim)
    return torch.cat([p.narrow(dim, rank * (p.shape[dim] // size), p.shape[dim] // size) for p in parts], dim)


def unpack_parts(x: torch.Tensor, dim: int, size: int, packed_splits: Sequence[int]) -> torch.Tensor:
    """Rank-major [p0_r0 p1_r0 .. | p0_r1 p1_r1 ..] along dim -> part-major [p0 | p1 | ..]."""
    local = [s // size for s in packed_splits]
    per_rank = [c.split(local, dim) for c in x.chunk(size, dim)]
    return torch.cat([per_rank[r][i] for i in range(len(local)) for r in range(size)], dim)


def gather_shards(
    shard: torch.Tensor, dim: int, group=None, packed_splits: Sequence[int] | None = None
) -> torch.Tensor:
    """Inverse of shard_tensor over `group` (collective: every rank calls it, every rank gets the full
    tensor). Not differentiable; for export and for checking weights / grads."""
    size = group_size(group)
    full = shard.detach().clone() if size == 1 else all_gather(shard.detach(), dim, group)
    return full if packed_splits is None or size == 1 else unpack_parts(full, dim, size, packed_splits)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- gradients
def _sum_groups(p: torch.Tensor) -> list:
    """The groups over which this parameter's local grad squares must be summed to cover it once:
    its own shard group, and every mesh dimension a DTensor (FSDP2) shards it over."""
    groups = []
    spec = shard_spec(p)
    if spec is not None and spec.sharded and spec.group is not None:
        groups.append(spec.group)
    if isinstance(p, DTensor):
        for i, placement in enumerate(p.placements):
            if isinstance(placement, Shard) and p.device_mesh.size(i) > 1:
                groups.append(p.device_mesh.get_group(i))
    return groups


def grad_sq_norm(parameters: Iterable[torch.Tensor], device=None) -> torch.Tensor:
    """Sum of squares of the global gradient (float64, shape ()), each element counted once: sharded
    parameters summed over their shard groups, replicated ones counted once (tied ones once).
    Collective over every group a parameter is sharded over: every rank of those groups calls it with
    the same model (parameters without a grad add 0 but still take part)."""
    params = unique_params(parameters)
    if device is None:
        device = local_tensor(params[0]).device if params else torch.device("cpu")
    buckets: dict[tuple, list] = {}  # groups to sum over -> [sq, groups]
    for p in params:
        groups = _sum_groups(p)
        key = tuple(id(g) for g in groups)
        if key not in buckets:
            buckets[key] = [torch.zeros((), dtype=torch.float64, device=device), groups]
        if p.grad is not None:
            buckets[key][0] += local_tensor(p.grad).detach().double().square().sum().to(device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for sq, groups in buckets.values():  # first-appearance order: the same on every rank
        for g in groups:
            sq = all_reduce(sq, g)
        total = total + sq
    return total


def grad_norm(parameters: Iterable[torch.Tensor], device=None) -> torch.Tensor:
    return grad_sq_norm(parameters, device).sqrt()


def scale_grads_to_norm_(parameters: Iterable[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """grads *= min(1, max_norm / (norm + 1e-6)), torch.nn.utils.clip_grads_with_norm_'s rule, applied to each
    rank's local shards (torch's version would mix FSDP2's DTensor grads with a plain-tensor norm). No host
    sync: a factor of 1 leaves grads unchanged."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in unique_params(parameters):
        if p.grad is not None:
            g = local_tensor(p.grad)
            g.mul_(coef.to(g.dtype).to(g.device))


def clip_grads_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the global norm (grad_norm); returns the norm before clipping (float64)."""
    params = unique_params(parameters)
    total = grad_norm(params)
    scale_grads_to_norm_(params, total, max_norm)
    return total


def _sum_grads_over(params: list[torch.Tensor], group_of) -> None:
    """SUM each parameter's local grad over group_of(spec) (skipped when None), one flat all-reduce per group,
    dtype and device."""
    buckets: dict[tuple, tuple] = {}
    for p in params:
        group = group_of(shard_spec(p))
        if group is not None and group_size(group) > 1:
            g = local_tensor(p.grad)
            buckets.setdefault((id(group), g.dtype, g.device), (group, []))[1].append(g)
    for group, grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))


def _with_grad(parameters: Iterable[torch.Tensor], keep) -> list[torch.Tensor]:
    """The unique parameters that have a grad and a ShardSpec for which keep(spec) holds."""
    return [
        p for p in unique_params(parameters) if p.grad is not None and shard_spec(p) is not None and keep(shard_spec(p))
    ]


_HOOKED = "_hfpar_partial_grad_hook"  # set on a Parameter whose grad a partial_grad_hooks hook already sums


def sync_partial_grads(parameters: Iterable[torch.Tensor]) -> int:
    """SUM the grads of parameters with a partial_grad_group over it (local shards line up under FSDP2:
    every rank of the group has the same dp layout). Once per optimizer step, after the last backward,
    before clipping. Parameters whose grad a partial_grad_hooks hook sums in backward are skipped (exactly one
    reduction: apply_tensor_parallel installs the hooks; a wrapper that replaces the Parameter objects, FSDP2,
    drops them with the flag, and this sync takes over). Returns how many grads were synchronised."""
    params = _with_grad(parameters, lambda s: s.partial_grad_group is not None)
    params = [p for p in params if not getattr(p, _HOOKED, False)]
    _sum_grads_over(params, lambda s: s.partial_grad_group)
    return len(params)


def partial_grad_hooks(parameters: Iterable[torch.Tensor]) -> int:
    """The in-backward form of sync_partial_grads, for backends that take grads inside backward (DeepSpeed
    ZeRO reduces and partitions them there): a hook sums each incoming grad over its partial_grad_group
    before it is accumulated. Every rank of the group runs the same graph, so hooks fire in the same order.
    Idempotent: a parameter gets one hook (flagged, so sync_partial_grads skips it); frozen ones none."""
    n = 0
    for p in unique_params(parameters):
        spec = shard_spec(p)
        if (
            spec is None
            or spec.partial_grad_group is None
            or group_size(spec.partial_grad_group) == 1
            or not p.requires_grad
            or getattr(p, _HOOKED, False)
        ):
            continue

        def hook(grad, group=spec.partial_grad_group):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        p.register_hook(hook)
        setattr(p, _HOOKED, True)
        n += 1
    return n


def reduce_dp_grads(parameters: Iterable[torch.Tensor]) -> int:
    """The data-parallel reduction of grads the backend leaves to hfpar (experts: SUM over the ranks holding
    the same experts, then / dp, which is the dp mean since each expert grad already sums its EP group)."""
    params = _with_grad(parameters, lambda s: s.dp_by_hfpar)  # one list: `parameters` may be a generator
    _sum_grads_over(params, lambda s: s.dp_reduce_group)
    for p in params:
        local_tensor(p.grad).div_(shard_spec(p).dp_size)
    return len(params)


# ----------------------------------------------------------------------------- state
@torch.no_grad()
def full_state_dict(model: nn.Module, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors under the model's own (HF) state-dict names. Collective over every group any parameter is
    sharded over (every rank calls it, every rank gets the dict). DTensors (FSDP2) are gathered over their
    mesh first; then each sharded parameter over its ShardSpec group (packed parts back in their original
    order; experts back to (E, ...)). Tied parameters stay one tensor.
    base: full tensors a backend already gathered (DeepSpeed), whose sharded entries are still this rank's."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:
            full = (
                base[name] if base is not None and name in base else (t.full_tensor() if isinstance(t, DTensor) else t)
            )
            spec = shard_spec(t)
            if spec is not None and spec.sharded and spec.group is not None:
                full = gather_shards(full, spec.dim, spec.group, spec.packed_splits)
            done[id(t)] = full.detach()
        out[name] = done[id(t)]
    return out
