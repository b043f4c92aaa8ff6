"""Chunked per-token log-probs and entropies (hfpar.parallel.chunked_logps) against F.log_softmax of the full logits.

    python -m pytest -q -p no:cacheprovider tests/distributed/test_chunked_logps.py

- the function: log-probs, entropies and the gradients of a non-linear function of the log-probs (as GRPO's: each
  token's gradient differs) w.r.t. the input, weight and bias equal the unchunked ones in fp32 (1e-6) for chunks that
  do and do not divide the rows, with ignored targets (log-prob 0, no gradient);
- a vocab-parallel head (2 gloo ranks, the vocab split in halves): the same values, the input gradient summed over
  the ranks and each rank's weight rows' gradient equal to the unsharded ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfpar.parallel.chunked_logps import chunked_token_logps
from tests.helpers.dist import run_distributed

IGNORE = -100


def _case(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.3
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE
    return x, w, b, t


def _objective(lp: torch.Tensor) -> torch.Tensor:
    """A per-token non-linear loss (each token's d loss / d lp differs)."""
    return (torch.exp(lp) * torch.arange(1, lp.numel() + 1, dtype=lp.dtype)).sum() + (lp**2).sum()


def _reference(x, w, b, t):
    z = F.linear(x, w, b)
    logp = torch.log_softmax(z, -1)
    valid = t != IGNORE
    lp = logp.gather(1, t.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1) * valid
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent.detach()


def _grads(fn, x, w, b, t):
    x, w, b = (p.clone().requires_grad_(True) for p in (x, w, b))
    lp, ent = fn(x, w, b, t)
    _objective(lp).backward()
    return lp.detach(), ent, x.grad, w.grad, b.grad


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("chunk", [1, 7, 37, 64])
def test_chunked_token_logps_are_exact_in_fp32(chunk):
    case = _case()
    want = _grads(_reference, *case)
    got = _grads(lambda *a: chunked_token_logps(*a, chunk=chunk), *case)
    for name, g, r in zip(("lp", "entropy", "x", "weight", "bias"), got, want):
        assert _rel(g, r) < 1e-6, name
    assert got[0][::5].abs().max() == 0  # ignored targets: 0


def test_no_grad_and_no_entropy_gradient():
    x, w, b, t = _case()
    with torch.no_grad():
        lp, ent = chunked_token_logps(x, w, b, t, chunk=8)
    ref_lp, ref_ent = _reference(x, w, b, t)
    assert _rel(lp, ref_lp) < 1e-6 and _rel(ent, ref_ent) < 1e-6
    lp, ent = chunked_token_logps(x.requires_grad_(True), w, b, t, chunk=8)
    assert lp.requires_grad and not ent.requires_grad


def _tp_worker(rank, world):
    from hfpar.parallel.comm import all_reduce

    x, w, b, t = _case()
    half = w.shape[0] // world
    rows = slice(rank * half, (rank + 1) * half)
    want = _grads(_reference, x, w, b, t)
    xs, ws, bs = x.clone().requires_grad_(True), w[rows].clone().requires_grad_(True), b[rows].clone()
    bs.requires_grad_(True)
    group = torch.distributed.group.WORLD
    lp, ent = chunked_token_logps(xs, ws, bs, t, group=group, chunk=6)
    _objective(lp).backward()
    grad_x = all_reduce(xs.grad.clone(), group)  # the head's input went through copy_to_parallel_region
    return {
        "lp": _rel(lp.detach(), want[0]),
        "entropy": _rel(ent, want[1]),
        "x": _rel(grad_x, want[2]),
        "weight": _rel(ws.grad, want[3][rows]),
        "bias": _rel(bs.grad, want[4][rows]),
    }


def test_vocab_parallel_head_equals_the_unsharded_one():
    for r in run_distributed(_tp_worker, 2):
        assert max(r.values()) < 1e-6, r
