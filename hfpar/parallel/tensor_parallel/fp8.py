"""A tensor-parallel layer's local matmul in fp8, through torchao's float8 training matmul.

    n, skipped = float8_shard_layers(blocks, config)   # config: torchao's Float8LinearConfig; in place
    layer.local_matmul = Float8ShardMatmul(config, layer.group, sharded="weight_rows" | "weight_cols")

torchao converts nn.Linear modules (Float8Linear) and, for DTensor tensor parallelism, scales each operand over the
whole mesh (its Float8ColwiseParallel / Float8RowwiseParallel, tensorwise only). hfpar's TP layers hold plain local
shards in their own modules, so neither applies: each layer's `_linear` calls torchao's autograd function (the one
Float8Linear.forward calls, with the input cast Float8Linear does first) on its shard.

Scales, so that TP computes what the one-process fp8 run computes:
  tensorwise  one amax per tensor: where an operand is sharded (the weight; a row-parallel layer's input, (B, T,
              in/tp); a column-parallel layer's output gradient, (B, T, out/tp)) hfpar casts it to fp8 itself with the
              amax all-reduced (max) over the TP group, as torchao does for DTensors; torchao's matmul takes an
              operand already in fp8 as it is. The same fp8 bits as one process.
  rowwise     one scale per row, a power of two: the per-row amax runs along the sharded dimension in two of the
              six casts (the forward of a row-parallel layer, the input gradient of a column-parallel one), which
              torchao's function computes on the shard (it takes no pre-cast operand for rowwise). There a row's
              scale differs from the one-process run's only when the shard's amax falls in another power of two
              than the whole row's: the TP run is the one-process fp8 run up to those re-rounded rows (measured:
              docs/mixed-precision.md#fp8).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import all_reduce, group_size
from .layers import ColumnParallelLinear, RowParallelLinear


def _cast_over_group(t: torch.Tensor, cast_config, role, mm_config, config, group):
    """`t` to fp8 with one scale for the whole (sharded) tensor: torchao's tensorwise cast with amax reduced over the
    group (its tensor_to_amax with reduce_amax, which needs a DeviceMesh where hfpar has a process group)."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8  # noqa: PLC0415
    from torchao.float8.float8_utils import amax_to_scale  # noqa: PLC0415

    amax = torch.max(torch.abs(t.detach()))  # in t's dtype, as torchao's tensor_to_amax
    if group_size(group) > 1:
        amax = all_reduce(amax, group, op=dist.ReduceOp.MAX)
    scale = amax_to_scale(amax, cast_config.target_dtype, config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, mm_config, role)


class _GradToFloat8OverGroup(torch.autograd.Function):
    """Identity forward; the gradient leaves in fp8, its scale reduced over the group (torchao's
    NoopFwToFloat8BwDynamic, with the reduction)."""

    @staticmethod
    def forward(ctx, y, matmul):
        ctx.matmul = matmul
        return y

    @staticmethod
    def backward(ctx, g):
        from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: PLC0415

        m = ctx.matmul
        cc = m.config.cast_config_grad_output
        return _cast_over_group(g, cc, GemmInputRole.GRAD_OUTPUT, m.mm_config, m.config, m.group), None


class Float8ShardMatmul:
    """x @ w.T of one TP layer's shard in fp8. sharded: "weight_rows" (column-parallel: w (out/tp, in), the output
    gradient sharded) or "weight_cols" (row-parallel: w (out, in/tp), the input sharded)."""

    def __init__(self, config, group, sharded: str):
        from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415

        self.config, self.group, self.sharded = config, group, sharded
        # torchao builds the GEMM settings (emulation, fast accumulation, padding) in Float8Linear's constructor
        self.mm_config = Float8Linear(16, 16, bias=False, config=config, device="meta").linear_mm_config
        tensorwise = all(
            c.scaling_granularity.name == "TENSORWISE"
            for c in (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
        )
        self.over_group = tensorwise and config.cast_config_input_for_grad_weight == config.cast_config_input

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: PLC0415
        from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: PLC0415

        if torch.is_autocast_enabled():  # as Float8Linear.forward: CUDA autocast's dtype (CPU's reaches its mm)
            x = x.to(torch.get_autocast_dtype("cuda"))
        c = self.config
        if self.over_group:
            w = _cast_over_group(w, c.cast_config_weight, GemmInputRole.WEIGHT, self.mm_config, c, self.group)
            if self.sharded == "weight_cols":  # row-parallel: the input (B, T, in/tp) is a shard too
                x = _cast_over_group(x, c.cast_config_input, GemmInputRole.INPUT, self.mm_config, c, self.group)
        y = matmul_with_hp_or_float8_args.apply(x, w.t(), self.mm_config, c)  # (B, T, out/tp) or partial (B, T, out)
        if self.over_group and self.sharded == "weight_rows":
            y = _GradToFloat8OverGroup.apply(y, self)
        return y


def float8_shard_layers(blocks: list[nn.Module], config) -> tuple[int, list[str]]:
    """Each Column / RowParallelLinear in the blocks (not the Conv1D variants: transposed weights) whose shard has
    dims multiples of 16 gets an fp8 local matmul. Returns (how many, the skipped ones as 'name (shape)')."""
    n, skipped = 0, []
    for block in blocks:
        for name, m in block.named_modules():
            if getattr(type(m), "_linear", None) not in (ColumnParallelLinear._linear, RowParallelLinear._linear):
                continue
            if m.weight.shape[0] % 16 or m.weight.shape[1] % 16:
                skipped.append(f"{name} {tuple(m.weight.shape)} (local shard)")
                continue
            sharded = "weight_rows" if isinstance(m, ColumnParallelLinear) else "weight_cols"
            m.local_matmul = Float8ShardMatmul(config, m.group, sharded)
            n += 1
    return n, skipped
