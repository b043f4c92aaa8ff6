"""The expert-parallel model's groups, parameters, padding mask and export, for the trainer and users' own loops.

    ep_group, edp_group = expert_parallel_groups(ep_size=2)           # collective: every rank, same args
    reduce_dp_grads(expert_parameters(model)); non_expert_parameters(model)   # the two gradient reductions
    handle = attach_moe_token_mask(model)                             # padding out of the router statistics
    model.save_pretrained(out, state_dict=gather_expert_state_dict(model))   # collective; a normal checkpoint

Gradient reduction (the trainer's job; nothing here reduces gradients):
    non_expert_parameters(model)  router, shared expert, attention, norms, embeddings: replicated over
                                  dp -> the usual data-parallel MEAN (sum over dp_group / dp).
    expert_parameters(model)      this rank's experts (ShardSpec kind "ep"): their grads already hold every
                                  token of the EP group; SUM over the expert-data-parallel group (ranks
                                  with the same experts, size dp/ep; spec.dp_reduce_group) and divide
                                  by dp (NOT dp/ep): hfpar.parallel.sharding.reduce_dp_grads. Exclude them
                                  from DDP's reduction and from its rank-0 broadcast at wrap time.
    grad norm                     sum of squares: non-expert once + expert all-reduced over ep_group.
Padding: HF decoder layers call `mlp(hidden_states)` without the mask; `attach_moe_token_mask(model)` hands
each forward's attention_mask to the MoE layers, which keep it for the backward's recomputation under
activation checkpointing (reentrant or not); or wrap forward and backward in `moe_token_mask(mask)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn

from ..comm import group_size
from ..groups import expert_rank_lists, new_groups
from ..sharding import full_state_dict, shard_spec
from .moe import MoELayer

__all__ = [
    "attach_moe_token_mask",
    "expert_parallel_groups",
    "expert_parameters",
    "gather_expert_state_dict",
    "non_expert_parameters",
]


def expert_parallel_groups(ep_size: int, dp_ranks: Sequence[Sequence[int]] | None = None):
    """(ep_group, edp_group) of this rank, for users' own code (hfpar's recipes get them from ParallelContext,
    which uses the same layout). Collective: every rank calls it with the same arguments.

    dp_ranks: the rank lists of ALL data-parallel groups (default: one group, the whole world). Inside a dp
    group D (size dp), EP groups are runs of ep_size consecutive entries D[i*ep:(i+1)*ep]; a rank's
    expert-data-parallel group is D[j::ep] (the ranks holding the same experts, size dp/ep)."""
    world = group_size(None)
    dp_ranks = [list(range(world))] if dp_ranks is None else [list(r) for r in dp_ranks]
    bad = [len(r) for r in dp_ranks if ep_size < 1 or len(r) % ep_size]
    if bad:
        raise ValueError(f"expert_parallel_groups: ep_size {ep_size} does not divide the data-parallel size {bad[0]}")
    ep_lists, edp_lists = expert_rank_lists(dp_ranks, ep_size)
    return new_groups(ep_lists), new_groups(edp_lists)


# ----------------------------------------------------------------------------- parameters, masks
def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Expert-parallel parameters (this rank's experts; empty when ep == 1). Reduce their grads as
    SUM over the expert-data-parallel group (their ShardSpec's dp_reduce_group, size dp/ep) / dp."""
    return (p for p in model.parameters() if _is_expert(p))


def non_expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Everything else, replicated over the data-parallel group: the usual dp mean."""
    return (p for p in model.parameters() if not _is_expert(p))


def _is_expert(p: torch.Tensor) -> bool:
    spec = shard_spec(p)
    return spec is not None and spec.kind == "ep"


class _MaskHandle:
    def __init__(self, model: nn.Module, handle):
        self.model, self.handle = model, handle

    def remove(self) -> None:
        self.handle.remove()
        for layer in self.model.modules():
            if isinstance(layer, MoELayer):
                layer.attached_mask = None


def attach_moe_token_mask(model: nn.Module) -> _MaskHandle:
    """Make `model(..., attention_mask=m)` (2-D, 1 = real token) hand `m` to every MoE layer of the model; each
    keeps the mask of the model's latest forward, so a backward that recomputes MoE layers (activation
    checkpointing, reentrant or not) routes with the same mask. An enclosing `with moe_token_mask(...)` takes
    precedence. Returns a handle with .remove()."""

    def pre(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        for layer in module.modules():  # the layers of now (apply / upcycle may come later)
            if isinstance(layer, MoELayer):
                layer.attached_mask = mask

    return _MaskHandle(model, model.register_forward_pre_hook(pre, with_kwargs=True))


# ----------------------------------------------------------------------------- export
@torch.no_grad()
def gather_expert_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Full state dict under the ORIGINAL HF names, experts gathered back to (E, ...). Collective over
    every EP group: every rank calls it, every rank gets the full dict.

    state_dict: a full dict the backend already gathered (FSDP / ZeRO-3 full state dict, in which the
    expert entries are still this rank's (E/ep, ...) slice); default: the model's own (TP shards
    gathered with gather_full_state_dict when tensor parallelism was applied)."""
    return full_state_dict(model, base=state_dict)
