"""Per-token entropy of the policy's next-token distribution (TRL's `entropy` metric), from full logits or from
their vocab-parallel shards (tensor parallelism: three all-reduces of (N,) values, never the full logits).

    ent = token_entropy(logits, tp_group)      # logits (N, V) or (N, V / tp); (N,) float32, no grad
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def token_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """H = log Z - E[x - m] with m the max logit, Z = sum exp(x - m), over the whole vocabulary."""
    x = logits.float()
    m = x.max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m.unsqueeze(-1))
    z = e.sum(-1)
    ex = (e * (x - m.unsqueeze(-1))).sum(-1)
    if group is not None:
        dist.all_reduce(z, group=group)
        dist.all_reduce(ex, group=group)
    return torch.log(z) - ex / z
