"""Tensor-parallel layers (Megatron style): column-, row- and vocab-parallel (loss.py: the matching cross-entropy).

    ColumnParallelLinear   W (out/tp, in)  shards the output features; bias sharded with them
    RowParallelLinear      W (out, in/tp)  shards the input features; output all-reduced (or
                           reduce-scattered along the sequence), bias added once after that
    VocabParallelEmbedding W (V/tp, H)     each rank looks up its vocab rows, then sum over ranks (embedding.py)

A Column -> Row pair (q/k/v -> o, gate/up -> down) needs one all-reduce forward and one backward.
With sequence_parallel=True activations between TP regions are sharded along the sequence,
(B, T/tp, H): Column all-gathers T in, Row reduce-scatters T out, the embedding reduce-scatters.

Parameters are plain nn.Parameters (DDP / FSDP2 / DeepSpeed wrap them as usual). Sharded ones
carry a ShardSpec (hfpar.parallel.sharding: kind "tp", group, dim 0 | 1, size, packed_splits), from
which the grad norm, the replicated-grad sync and the gathered state dict are computed.

Build from an existing layer (same seed => same math as the single-process model):

    # torchrun --nproc_per_node 2 -m hfpar.parallel.tensor_parallel.layers     (runs this example, checked)
    torch.manual_seed(0)
    up, down = nn.Linear(16, 64), nn.Linear(64, 16)               # the same on every rank
    col = ColumnParallelLinear.from_linear(up, group)             # W (64/tp, 16)
    row = RowParallelLinear.from_linear(down, group)              # W (16, 64/tp)
    x = torch.randn(2, 5, 16)                                      # (B, T, H), same on every rank
    y = row(F.gelu(col(x)))                                        # (B, T, H) == down(gelu(up(x)))
    row.full_weight()                                              # (16, 64) on every rank (collective)
    fused = nn.Linear(16, 48)                                      # q | k | v = 32 | 8 | 8 rows
    qkv = ColumnParallelLinear.from_linear(fused, group, packed_splits=[32, 8, 8])  # (16+4+4, 16) at tp=2
    qkv.to_linear()                                                # == fused, parts in order (collective)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)
from ..sharding import ShardSpec, gather_shards, shard_tensor, unpack_parts
from .embedding import VocabParallelEmbedding
from .params import _check_divisible, _copy, _full_linear, _grads, _mark, _param

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "gather_shards",
    "shard_tensor",
    "tp_sharded_parameters",
]


# ----------------------------------------------------------------------------- linear layers
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output features: W (out/tp, in), b (out/tp,).

    Input (B, T, in) replicated, or (B, T/tp, in) with sequence_parallel. Output (B, T, out/tp),
    or (B, T, out) with gather_output. packed_splits: out_features is a concatenation of parts
    (fused qkv / gate_up); each rank holds its slice of every part, in part order.
    in_region: the input already entered the TP region (a module-level hook did the copy / all-gather).
    """

    weight_shard_dim = 0
    in_region = False
    local_matmul = None  # (x, local W) -> x @ W^T set per layer, e.g. fp8 (tensor_parallel/fp8.py); None: F.linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group=None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        packed_splits: Sequence[int] | None = None,
        device=None,
        dtype=None,
        name: str | None = None,
    ):
        super().__init__()
        tp = group_size(group)
        label = name or f"ColumnParallelLinear(in_features={in_features}, out_features={out_features})"
        if packed_splits is not None:
            if sum(packed_splits) != out_features:
                raise ValueError(
                    f"{label}: packed_splits {list(packed_splits)} sum to {sum(packed_splits)}, "
                    f"not out_features={out_features}"
                )
            for i, s in enumerate(packed_splits):
                _check_divisible(label, f"packed_splits[{i}]", s, tp)
        _check_divisible(label, "out_features", out_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp, self.rank = group, tp, group_rank(group)
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.packed_splits = None if packed_splits is None else [int(s) for s in packed_splits]
        # Same RNG stream as nn.Linear(in, out): initialise the full weight, keep this rank's rows.
        self._load_full(*_full_linear(in_features, out_features, bias, device, dtype))

    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None, requires_grad=(True, True)) -> None:
        d = self.weight_shard_dim  # 0: (out/tp, in)
        w = shard_tensor(weight.detach(), d, self.rank, self.tp, self.packed_splits)
        self.weight = _mark(_param(w, requires_grad[0]), d, self.group, self.tp, self.packed_splits)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            b = shard_tensor(bias.detach(), 0, self.rank, self.tp, self.packed_splits)  # (out/tp,)
            self.bias = _mark(_param(b, requires_grad[1]), 0, self.group, self.tp, self.packed_splits)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group=None,
        *,
        packed_splits: Sequence[int] | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        name: str | None = None,
    ) -> ColumnParallelLinear:
        """Shard an existing nn.Linear (any device, meta included) for this rank of `group`."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=group,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            packed_splits=packed_splits,
            device="meta",
            dtype=linear.weight.dtype,
            name=name,
        )
        layer._load_full(linear.weight, linear.bias, _grads(linear))
        return layer

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.local_matmul is None:
            return F.linear(x, self.weight, self.bias)
        y = self.local_matmul(x, self.weight)  # (B, T, out/tp)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit_region(self._linear(self.enter_region(x)))

    # The three steps of forward, apart so that an adapter (tensor_parallel/lora.py) adds its local product
    # between them: enter_region(x) -> local (B, T, out/tp) -> exit_region.
    def enter_region(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and not self.in_region:  # in a region: its hook did this once for q/k/v
            return gather_from_sequence_parallel_region(x, self.sequence_dim, self.group)  # (B, T/tp, in) -> (B, T, in)
        if not self.in_region:
            return copy_to_parallel_region(x, self.group)  # (B, T, in)
        return x

    def exit_region(self, y: torch.Tensor) -> torch.Tensor:
        """y: this rank's (B, T, out/tp)."""
        if self.gather_output:
            y = gather_from_parallel_region(y, self.group)  # (B, T, out)
            if self.packed_splits is not None and self.tp > 1:
                y = unpack_parts(y, y.dim() - 1, self.tp, self.packed_splits)
        return y

    def full_weight(self) -> torch.Tensor:
        """(out, in) on every rank, parts in their original order. Collective."""
        return gather_shards(self.weight, 0, self.group, self.packed_splits)

    def full_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else gather_shards(self.bias, 0, self.group, self.packed_splits)

    def to_linear(self) -> nn.Linear:
        """The equivalent single-device nn.Linear (collective; for export)."""
        return _linear_from(self.full_weight(), self.full_bias())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}, tp={self.tp}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, packed_splits={self.packed_splits}"
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input features: W (out, in/tp), b (out,) replicated.

    Input (B, T, in/tp) (input_is_parallel, e.g. a ColumnParallelLinear's output) or (B, T, in).
    Output (B, T, out) all-reduced, or (B, T/tp, out) reduce-scattered with sequence_parallel.
    The bias is added once, after the reduction. Under sequence_parallel each rank adds it to its
    own tokens only, so its gradient is all-reduced over the group (stays replicated and exact).
    """

    weight_shard_dim = 1
    local_matmul = None  # as ColumnParallelLinear's

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group=None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        name: str | None = None,
    ):
        super().__init__()
        tp = group_size(group)
        label = name or f"RowParallelLinear(in_features={in_features}, out_features={out_features})"
        _check_divisible(label, "in_features", in_features, tp)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{label}: sequence_parallel=True needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp, self.rank = group, tp, group_rank(group)
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (
            input_is_parallel,
            sequence_parallel,
            sequence_dim,
        )
        self._load_full(*_full_linear(in_features, out_features, bias, device, dtype))

    def _load_full(self, weight: torch.Tensor, bias: torch.Tensor | None, requires_grad=(True, True)) -> None:
        d = self.weight_shard_dim  # 1: (out, in/tp)
        w = shard_tensor(weight.detach(), d, self.rank, self.tp)
        self.weight = _mark(_param(w, requires_grad[0]), d, self.group, self.tp)
        if bias is None:
            self.register_parameter("bias", None)
        else:  # (out,) replicated
            self.bias = _param(_copy(bias), requires_grad[1])

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group=None,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        name: str | None = None,
    ) -> RowParallelLinear:
        """Shard an existing nn.Linear (any device, meta included) for this rank of `group`."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=group,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            device="meta",
            dtype=linear.weight.dtype,
            name=name,
        )
        layer._load_full(linear.weight, linear.bias, _grads(linear))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit_region(self._linear(self.enter_region(x)))

    # forward's steps apart, as ColumnParallelLinear's: an adapter adds its partial sums before the reduction
    def enter_region(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            return scatter_to_parallel_region(x, self.group)  # (B, T, in) -> (B, T, in/tp)
        return x

    def exit_region(self, y: torch.Tensor) -> torch.Tensor:
        """y: this rank's partial sums (B, T, out); the reduction, then the bias."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.sequence_dim, self.group)  # (B, T/tp, out)
            bias = None if self.bias is None else copy_to_parallel_region(self.bias, self.group)
        else:
            y = reduce_from_parallel_region(y, self.group)  # (B, T, out)
            bias = self.bias
        return y if bias is None else y + bias

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.local_matmul is None else self.local_matmul(x, self.weight)

    def full_weight(self) -> torch.Tensor:
        """(out, in) on every rank. Collective."""
        return gather_shards(self.weight, 1, self.group)

    def full_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach().clone()

    def to_linear(self) -> nn.Linear:
        return _linear_from(self.full_weight(), self.full_bias())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = nn.Parameter(weight)
    if bias is not None:
        lin.bias = nn.Parameter(bias)
    return lin


def tp_sharded_parameters(model: nn.Module):
    """Yield (qualified name, parameter, ShardSpec) for every TP-sharded parameter of `model`.

    Found through the TP modules, so it also works after a wrapper (FSDP2) replaced the Parameter
    objects. Parameters not yielded are replicated across the TP group (row-parallel biases, norms).
    """
    seen: set[int] = set()  # a tied lm_head / embedding: once
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            packed = getattr(mod, "packed_splits", None)
            names = ("weight", "bias") if isinstance(mod, ColumnParallelLinear) else ("weight",)
            for n in names:
                p = getattr(mod, n, None)
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    dim = mod.weight_shard_dim if n == "weight" else 0
                    spec = ShardSpec(kind="tp", group=mod.group, dim=dim, size=mod.tp, packed_splits=packed)
                    yield (f"{mod_name}.{n}" if mod_name else n), p, spec


def _demo(rank: int, world_size: int) -> None:
    """The module docstring's example, checked against the single-process layers."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    up, down = nn.Linear(16, 64), nn.Linear(64, 16)
    col, row = ColumnParallelLinear.from_linear(up, group), RowParallelLinear.from_linear(down, group)
    x = torch.randn(2, 5, 16)  # (B, T, H)
    y = row(F.gelu(col(x)))  # (B, T, H)
    assert torch.allclose(y, down(F.gelu(up(x))), atol=1e-5)
    assert torch.equal(row.full_weight(), down.weight.detach())
    fused = nn.Linear(16, 48)
    qkv = ColumnParallelLinear.from_linear(fused, group, packed_splits=[32, 8, 8])
    assert torch.equal(qkv.to_linear().weight, fused.weight) and qkv.weight.shape[0] == 48 // world_size
    if rank == 0:
        print("ok:", tuple(x.shape), "->", tuple(col.weight.shape), tuple(row.weight.shape), "->", tuple(y.shape))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    _demo(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
