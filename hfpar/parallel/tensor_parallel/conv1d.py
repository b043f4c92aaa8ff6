"""Column / row parallel versions of transformers' Conv1D (GPT-2): a Linear whose weight is stored transposed.

    Conv1D(nf=out, nx=in)      weight (in, out), y = x @ W + b
    ColumnParallelConv1D       weight (in, out/tp)  ShardSpec dim 1; bias (out/tp,)   (c_attn packed q|k|v, c_fc)
    RowParallelConv1D          weight (in/tp, out)  ShardSpec dim 0; bias (out,) replicated   (c_proj)

The shards keep Conv1D's layout, so gather_full_state_dict writes GPT-2's own names AND shapes (a square
c_proj can never come back silently transposed). Collectives, regions and sequence parallelism are the
parent classes' (layers.py); only the local matmul and the storage layout differ.

    col = ColumnParallelConv1D.from_conv1d(block.attn.c_attn, group, packed_splits=[E, E, E])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..sharding import gather_shards
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelConv1D", "RowParallelConv1D", "is_conv1d"]


def is_conv1d(mod: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D (duck-typed: the layer library does not import transformers)."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx") and mod.weight.dim() == 2


def _grads(conv: nn.Module) -> tuple[bool, bool]:
    return conv.weight.requires_grad, conv.bias is not None and conv.bias.requires_grad


class ColumnParallelConv1D(ColumnParallelLinear):
    """Conv1D split by output features: W (in, out/tp), b (out/tp,); see ColumnParallelLinear. Build it with
    from_conv1d (the constructor's own initialisation is the parent's and only a placeholder)."""

    weight_shard_dim = 1

    @classmethod
    def from_conv1d(
        cls,
        conv: nn.Module,
        group=None,
        *,
        packed_splits: Sequence[int] | None = None,
        sequence_parallel: bool = False,
        name: str | None = None,
    ) -> ColumnParallelConv1D:
        layer = cls(
            conv.nx,
            conv.nf,
            conv.bias is not None,
            group=group,
            sequence_parallel=sequence_parallel,
            packed_splits=packed_splits,
            device="meta",
            dtype=conv.weight.dtype,
            name=name,
        )
        layer._load_full(conv.weight, conv.bias, _grads(conv))
        return layer

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight  # (B, T, out/tp)
        return y if self.bias is None else y + self.bias

    def full_weight(self) -> torch.Tensor:
        """(in, out) Conv1D layout on every rank, parts in their original order. Collective."""
        return gather_shards(self.weight, 1, self.group, self.packed_splits)

    def to_linear(self) -> nn.Linear:
        raise NotImplementedError("ColumnParallelConv1D: use full_weight() (Conv1D layout (in, out))")


class RowParallelConv1D(RowParallelLinear):
    """Conv1D split by input features: W (in/tp, out), b (out,) replicated; see RowParallelLinear. Build it with
    from_conv1d."""

    weight_shard_dim = 0

    @classmethod
    def from_conv1d(
        cls, conv: nn.Module, group=None, *, sequence_parallel: bool = False, name: str | None = None
    ) -> RowParallelConv1D:
        layer = cls(
            conv.nx,
            conv.nf,
            conv.bias is not None,
            group=group,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            device="meta",
            dtype=conv.weight.dtype,
            name=name,
        )
        layer._load_full(conv.weight, conv.bias, _grads(conv))
        return layer

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # (B, T, out) partial sums

    def full_weight(self) -> torch.Tensor:
        """(in, out) Conv1D layout on every rank. Collective."""
        return gather_shards(self.weight, 0, self.group)

    def to_linear(self) -> nn.Linear:
        raise NotImplementedError("RowParallelConv1D: use full_weight() (Conv1D layout (in, out))")
