"""What the tensor-parallel layers share: their sharded parameters built and marked with a ShardSpec.

Used by layers.py (column / row layers) and embedding.py, e.g. a (out/tp, in) shard marked as such:
    w = _mark(_param(shard_tensor(full, 0, rank, tp), True), 0, group, tp)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..sharding import ShardSpec, set_shard_spec


def _check_divisible(layer: str, what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"{layer}: {what}={n} is not divisible by the tensor-parallel size {tp}")


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if t.is_meta else t.detach().clone()


def _full_linear(in_features: int, out_features: int, bias: bool, device, dtype):
    """Full (weight, bias) drawn exactly like nn.Linear(in, out) (same RNG stream); uninitialised on meta."""
    if _is_meta(device):
        return (
            torch.empty(out_features, in_features, device="meta", dtype=dtype),
            torch.empty(out_features, device="meta", dtype=dtype) if bias else None,
        )
    full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
    return full.weight, full.bias


def _mark(param: nn.Parameter, dim: int, group, tp: int, packed_splits=None) -> nn.Parameter:
    return set_shard_spec(
        param,
        ShardSpec(
            kind="tp",
            group=group,
            dim=dim,
            size=tp,
            packed_splits=None if packed_splits is None else list(packed_splits),
        ),
    )


def _param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=requires_grad)


def _grads(linear: nn.Linear) -> tuple[bool, bool]:
    """Keep a frozen source's requires_grad (e.g. LoRA base weights)."""
    return linear.weight.requires_grad, linear.bias is not None and linear.bias.requires_grad
