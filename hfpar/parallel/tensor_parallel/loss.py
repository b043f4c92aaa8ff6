"""Cross-entropy from vocab-parallel logit shards: the full (N, V) logits are never gathered.

logits = model(ids).logits                       # (B, T, V/tp) after apply_tensor_parallel (LM head sharded)
loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], group=tp_group)   # == F.cross_entropy on full logits
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


# ----------------------------------------------------------------------------- cross-entropy
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Saves only the local softmax (N, V/tp) and reuses its memory for the gradient."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction):
        tp, vl = group_size(group), logits.shape[-1]
        start, vocab = group_rank(group) * vl, vl * tp
        x = logits.reshape(-1, vl)  # (N, V/tp)
        t = target.reshape(-1)  # (N,)
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 (or fp64) math
        m = x.max(dim=-1).values.to(acc)  # (N,) local max
        if tp > 1:
            m = all_reduce(m, group, op=dist.ReduceOp.MAX)  # global max
        z = x.to(acc, copy=True).sub_(m.unsqueeze(-1))  # (N, V/tp), one new tensor
        valid = t != ignore_index
        mine = valid & (t >= start) & (t < start + vl)  # target row is local
        lt = (t - start).masked_fill(~mine, 0)
        z_t = z.gather(1, lt.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # (N,) target logit or 0
        sum_z = z.sum(-1) if label_smoothing > 0 else torch.zeros_like(z_t)  # (N,) for smoothing
        z.exp_()
        stats = torch.stack([z.sum(-1), z_t, sum_z])  # (3, N)
        if tp > 1:
            stats = all_reduce(stats, group)  # one sum over ranks
        sum_exp, z_t, sum_z = stats.unbind(0)
        lse = sum_exp.log()  # log-sum-exp - m
        loss = lse - z_t
        if label_smoothing > 0:  # -mean_v log p_v
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_z / vocab)
        loss = loss.masked_fill(~valid, 0.0)
        n_valid = valid.sum()
        if reduction == "mean":
            out = loss.sum() / n_valid
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.view(target.shape)
        probs = z.div_(sum_exp.unsqueeze(-1))  # (N, V/tp) softmax shard
        ctx.save_for_backward(probs, lt, mine, valid, n_valid)
        ctx.meta = (label_smoothing, vocab, reduction, logits.dtype, logits.shape)
        ctx.used = False
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: backward reuses its saved softmax in place "
                "and can run only once (no retain_graph double backward)"
            )
        ctx.used = True
        probs, lt, mine, valid, n_valid = ctx.saved_tensors
        eps, vocab, reduction, dtype, shape = ctx.meta
        grad = probs  # (N, V/tp), in place
        if eps > 0:
            grad.sub_(eps / vocab)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, lt] -= (1.0 - eps) * mine.to(grad.dtype)  # d/dz of -(1-eps) z_t
        if reduction == "none":
            scale = g.reshape(-1).to(grad.dtype) * valid
        else:
            scale = valid.to(grad.dtype) * (g.to(grad.dtype) / n_valid if reduction == "mean" else g.to(grad.dtype))
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(dtype).view(shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over a vocab sharded like ColumnParallelLinear's output.

    logits_shard: (..., V/tp), this rank's contiguous vocab slice [r*V/tp, (r+1)*V/tp), classes LAST.
    target: (...,) full-vocab ids, the same on every rank. Equals
    F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=..., label_smoothing=...,
    reduction=...) ("none" keeps target's shape, 0 at ignored positions; "mean" divides by the
    non-ignored count). Computed in fp32 (fp64 stays fp64); the loss is returned in that dtype and
    is the same on every rank. Costs two all-reduces of O(N) numbers and keeps one (N, V/tp) tensor.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be mean|sum|none, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits_shard.shape)} (classes last) do not "
            f"match target {tuple(target.shape)}"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, group, ignore_index, float(label_smoothing), reduction
    )
