"""A rank's piece of a full (one-process) tensor, described in plain values so that pieces written by one mesh can be
joined back offline and cut again for another mesh (resume on another mesh, `hfpar export` of any checkpoint).

    desc = piece_layout(param)               # {"tp": [dim, rank, size, packed_splits] | None, "shape": [...],
                                             #  "offset": [...]}: JSON / weights_only-safe values
    full = join_pieces([(desc0, t0), (desc1, t1), ...])      # every piece of one tensor (replicas may repeat)
    local = piece_of(full, live_param)       # this rank's piece for a live tensor (ShardSpec, then DTensor)

Two levels, in the order hfpar applies them: the ShardSpec (TP / EP: 1/size of the full tensor along `dim`, packed
parts split each) and, on top, a DTensor's placements over its mesh (FSDP2: dim-0 chunks of the TP-local tensor).
`shape` is the TP-local (DTensor global) shape and `offset` where this rank's local tensor starts inside it, as torch
computes it for the placements (compute_local_shape_and_global_offset), so any placement DTensor allows is covered.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .sharding import shard_spec, shard_tensor, unpack_parts

__all__ = ["join_pieces", "piece_layout", "piece_of"]


def _rank_in(group) -> int:
    return torch.distributed.get_rank(group) if group is not None else 0


def piece_layout(t: torch.Tensor) -> dict:
    """Where this rank's local tensor of `t` sits in the full tensor (plain values)."""
    spec = shard_spec(t)
    tp = None
    if spec is not None and spec.sharded:
        tp = [spec.dim, _rank_in(spec.group), spec.size, list(spec.packed_splits) if spec.packed_splits else None]
    if isinstance(t, DTensor):
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return {"tp": tp, "shape": list(t.shape), "offset": [int(o) for o in offset]}
    return {"tp": tp, "shape": list(t.shape), "offset": [0] * t.dim()}


def _place(out: torch.Tensor, piece: torch.Tensor, offset: list[int]) -> None:
    view = out
    for d, (o, n) in enumerate(zip(offset, piece.shape)):
        view = view.narrow(d, o, n)
    view.copy_(piece)


def join_pieces(pieces: Iterable[tuple[dict, torch.Tensor]]) -> torch.Tensor:
    """The full tensor from its pieces (each (piece_layout, local tensor)); repeated pieces (data-parallel replicas)
    are taken once. Raises ValueError when a TP rank's pieces do not cover its shape."""
    out: dict[int, torch.Tensor] = {}  # tp rank -> its TP-local tensor, being filled
    seen: dict[int, set] = {}  # tp rank -> offsets placed
    covered: dict[int, int] = {}
    tp = None
    for desc, t in pieces:
        tp = desc["tp"]
        rank = tp[1] if tp else 0
        if rank not in out:
            out[rank], seen[rank], covered[rank] = torch.empty(desc["shape"], dtype=t.dtype), set(), 0
        if t.dim() == 0:  # a scalar (an optimizer's step): every rank holds all of it
            out[rank], covered[rank] = t.clone(), 1
        elif tuple(desc["offset"]) not in seen[rank]:
            seen[rank].add(tuple(desc["offset"]))
            _place(out[rank], t, desc["offset"])
            covered[rank] += t.numel()
    for rank, t in out.items():
        if covered[rank] != t.numel():
            raise ValueError(f"tensor-parallel rank {rank}: pieces cover {covered[rank]} of {t.numel()} elements")
    if not tp:
        return out[0]
    dim, _, size, packed = tp
    if sorted(out) != list(range(size)):
        raise ValueError(f"pieces of {sorted(out)} of {size} tensor-parallel ranks")
    if out[0].dim() == 0:
        return out[0]
    full = torch.cat([out[r] for r in range(size)], dim)
    return unpack_parts(full, dim, size, packed) if packed else full


def piece_of(full: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of `full` for the live tensor `live` (its ShardSpec's shard, then its DTensor's
    local part), as a new tensor in live's dtype on live's device. Collective-free."""
    spec = shard_spec(live)
    t = full
    if spec is not None and spec.sharded:
        t = shard_tensor(t, spec.dim, _rank_in(spec.group), spec.size, spec.packed_splits)
    if isinstance(live, DTensor):
        shape, offset = compute_local_shape_and_global_offset(live.shape, live.device_mesh, live.placements)
        for d, (o, n) in enumerate(zip(offset, shape)):
            t = t.narrow(d, o, n)
    local = live.to_local() if isinstance(live, DTensor) else live
    if tuple(t.shape) != tuple(local.shape):
        raise ValueError(f"a piece of shape {tuple(t.shape)} for a local tensor of shape {tuple(local.shape)}")
    return t.to(device=local.device, dtype=local.dtype).contiguous()
