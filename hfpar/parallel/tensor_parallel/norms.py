"""A head-spanning RMSNorm on sharded heads: the norm over ALL heads (OLMo-2/3's, FlexOlmo's, MiniMax-M2's q_norm /
k_norm over the whole q / k projection) computed exactly on this rank's heads.

    norm = ShardedRMSNorm.from_norm(attn.q_norm, group)     # weight (N/tp,), this rank's slice (ShardSpec "tp", dim 0)
    y = norm(q_local)                                       # (B, T, N/tp) == the full norm's output, this rank's slice

y = w * x / sqrt(mean_N(x^2) + eps): the sum of squares over this rank's N/tp features is all-reduced over the TP
group (one (B, T, 1) all-reduce forward and one backward; the mean divides by the full N). Computed in float32 like
the families' own norms, the weight applied before the cast back (OLMo-2's order; MiniMax-M2 multiplies after the
cast: one rounding apart in bf16, identical in fp32). HF's own TP gathers the full projection instead
(colwise_gather_output): hfpar keeps the heads sharded. LayerNorm-style norms (a mean and a bias) are not handled:
they are refused by validation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import group_rank, group_size
from ..sharding import ShardSpec, gather_shards, set_shard_spec, shard_tensor

__all__ = ["ShardedRMSNorm", "rmsnorm_problem"]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward AND backward: every rank uses the sum with its own features, so the sum's gradient is
    the sum of every rank's (unlike reduce_from_parallel_region, whose output feeds replicated computation)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _eps(norm: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(norm, attr, None)
        if isinstance(v, float):
            return v
    return None


def rmsnorm_problem(norm: nn.Module, tp: int) -> str | None:
    """Why `norm` cannot become a ShardedRMSNorm (None: it can)."""
    w = getattr(norm, "weight", None)
    if "RMSNorm" not in type(norm).__name__ or not isinstance(w, torch.Tensor) or w.dim() != 1:
        return f"{type(norm).__name__} is not an RMSNorm with a 1-D weight (head-spanning LayerNorms are not supported)"
    if getattr(norm, "bias", None) is not None or _eps(norm) is None:
        return f"{type(norm).__name__} has a bias or no epsilon attribute"
    if w.numel() % tp:
        return f"its width {w.numel()} is not divisible by tp_size {tp}"
    return None


class ShardedRMSNorm(nn.Module):
    """RMSNorm over N features of which this rank holds N/tp (the colwise shard of the projection it follows)."""

    def __init__(self, weight: torch.Tensor, eps: float, group, name: str | None = None):
        super().__init__()
        self.group, self.tp, self.rank, self.eps = group, group_size(group), group_rank(group), eps
        self.full_size, self.name = weight.numel(), name
        w = shard_tensor(weight.detach(), 0, self.rank, self.tp)  # (N/tp,)
        self.weight = set_shard_spec(
            nn.Parameter(w, requires_grad=weight.requires_grad), ShardSpec(kind="tp", group=group, dim=0, size=self.tp)
        )

    @classmethod
    def from_norm(cls, norm: nn.Module, group, name: str | None = None) -> ShardedRMSNorm:
        why = rmsnorm_problem(norm, group_size(group))
        if why is not None:
            raise ValueError(f"{name or type(norm).__name__}: {why}")
        return cls(norm.weight, _eps(norm), group, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)  # (..., N/tp)
        sq = _SumOverGroup.apply(h.pow(2).sum(-1, keepdim=True), self.group)  # (..., 1) over all N
        h = h * torch.rsqrt(sq / self.full_size + self.eps)
        return (self.weight * h).to(dtype)

    def full_weight(self) -> torch.Tensor:
        """(N,) on every rank. Collective."""
        return gather_shards(self.weight, 0, self.group)

    def extra_repr(self) -> str:
        return f"{self.full_size} (local {self.weight.numel()}), eps={self.eps}, tp={self.tp}"
