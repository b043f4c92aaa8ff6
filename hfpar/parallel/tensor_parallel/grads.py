"""Gradients and export of a tensor-parallel model: thin names for users' own loops.

    loss.backward(); sync_sequence_parallel_grads(model); norm = clip_tp_grad_norm_(model.parameters(), 1.0)
    model.save_pretrained(out, state_dict=gather_full_state_dict(model))    # collective; rank 0 writes

The one implementation is hfpar.parallel.sharding (each parameter's ShardSpec names its groups, so the `group`
arguments below are accepted for compatibility and unused).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from ..sharding import clip_grads_, full_state_dict, grad_norm, partial_grad_hooks, sync_partial_grads

__all__ = [
    "clip_tp_grad_norm_",
    "gather_full_state_dict",
    "sequence_parallel_grad_hooks",
    "sync_sequence_parallel_grads",
    "tp_grad_norm",
]


# ----------------------------------------------------------------------------- gradients, export
def sync_sequence_parallel_grads(model: nn.Module) -> int:
    """SUM over the TP group the grads of replicated params that saw part of the data (SP norms, q/k norms
    applied to local heads) and that no backward hook sums already (apply_tensor_parallel installs them; a
    wrapper that replaces the parameters, FSDP2, drops them). Once per optimizer step after the last backward,
    before clipping; returns how many grads it summed (0 on a model apply_tensor_parallel returned)."""
    return sync_partial_grads(model.parameters())


def sequence_parallel_grad_hooks(model: nn.Module) -> int:
    """In-backward form of sync_sequence_parallel_grads (for DeepSpeed ZeRO, which takes grads in backward)."""
    return partial_grad_hooks(model.parameters())


def tp_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, group=None) -> torch.Tensor:  # noqa: ARG001
    """Global L2 norm of the grads, every shard counted once (collective over the TP group)."""
    return grad_norm(parameters)


def clip_tp_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, group=None) -> torch.Tensor:  # noqa: ARG001
    """Scale grads so their global norm is at most max_norm; returns the norm before."""
    return clip_grads_(parameters, max_norm)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors under the ORIGINAL HF names (collective; packed projections in their original order, tied
    weights one tensor): `model.save_pretrained(d, state_dict=...)` on one rank writes a normal checkpoint."""
    return full_state_dict(model)
