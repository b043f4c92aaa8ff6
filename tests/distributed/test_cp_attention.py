"""Context-parallel attention (ring, Ulysses) against unsharded SDPA, forward and backward, float64, 2 and 4 gloo ranks.

Rows: one causal document; packed documents whose boundaries straddle the shard cuts, with right padding; uneven
document lengths; GQA with kv heads fewer than cp (Ulysses repeats them); sliding windows (fused kernel with band
masks) and logit soft-capping (the blockwise fallback); attention sinks (GPT-OSS: the sink logits' gradient too);
the ring's all-gather form. Reference: SDPA over the full
row with a document-causal (windowed) mask built directly from the documents; with soft-capping, the same in
explicit float64 ops (cap * tanh(s / cap) before the mask, as Gemma 2's eager attention).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hfpar.parallel.comm import all_gather
from hfpar.parallel.context_parallel.attention import ring_attention, ulysses_attention
from hfpar.parallel.context_parallel.layout import (
    document_ids,
    gathered_order,
    shard_batch,
    zigzag_indices,
)
from tests.helpers.dist import run_distributed

T, D = 32, 8


def _rows(case: str, b: int = 2):
    """position_ids and attention_mask of `case` (B, T)."""
    pos = torch.arange(T).repeat(b, 1)
    mask = torch.ones(b, T, dtype=torch.long)
    if case == "packed":  # documents of 5, 11, 9 tokens then 7 of padding; row 2: 13 + 19
        pos[0] = torch.cat([torch.arange(5), torch.arange(11), torch.arange(9), torch.arange(7)])
        mask[0, 25:] = 0
        pos[1] = torch.cat([torch.arange(13), torch.arange(19)])
    if case == "uneven":  # 1-token documents next to long ones
        pos[0] = torch.cat([torch.arange(1), torch.arange(1), torch.arange(29), torch.arange(1)])
        pos[1] = torch.cat([torch.arange(3), torch.arange(28), torch.arange(1)])
    return pos, mask


def _reference_mask(pos, mask, window=None):
    doc = document_ids(pos, mask)  # (B, T)
    same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    if window is not None:  # transformers: q - w < k <= q
        causal = causal & ~torch.ones(T, T, dtype=torch.bool, device=doc.device).tril(-window)
    pad_self = (doc[:, :, None] < 0) & torch.eye(T, dtype=torch.bool, device=doc.device)
    return ((same & causal) | pad_self)[:, None]


def _reference(q, k, v, mask, softcap, sink=None):
    if not softcap and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sink is None:
        return torch.softmax(s, -1) @ v
    # attention sinks as GPT-OSS's eager attention: one more logit per head in each softmax, its share dropped
    s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    return torch.softmax(s, -1)[..., :-1] @ v


def _check(rank, world, case, mode, h, hkv, block=512, device="cpu", dtype=torch.float64, **opts):
    group = torch.distributed.group.WORLD
    g = torch.Generator().manual_seed(0)
    pos, mask = (x.to(device) for x in _rows(case))
    q, k, v, w = (
        torch.randn(2, n, T, D, generator=g, dtype=torch.float64).to(device, dtype) for n in (h, hkv, hkv, h)
    )  # w: d loss / d out
    sink = torch.randn(h, generator=g, dtype=torch.float64).to(device, dtype) if opts.pop("sink", False) else None
    # reference: the whole row on one rank
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    sf = None if sink is None else sink.clone().requires_grad_()
    rep = h // hkv
    out_ref = _reference(
        qf,
        kf.repeat_interleave(rep, 1),
        vf.repeat_interleave(rep, 1),
        _reference_mask(pos, mask, opts.get("window")),
        opts.get("softcap"),
        sf,
    )
    (out_ref * w).sum().backward()
    # this rank's shard
    batch = {
        "input_ids": torch.zeros(2, T, dtype=torch.long, device=device),
        "position_ids": pos,
        "attention_mask": mask,
    }
    _, rows = shard_batch(batch, rank, world)
    idx = zigzag_indices(T, rank, world).to(device)
    ql, kl, vl = (x[:, :, idx].clone().requires_grad_() for x in (q, k, v))
    sl = None if sink is None else sink.clone().requires_grad_()
    fn = ring_attention if mode == "ring" else ulysses_attention
    out = fn(ql, kl, vl, rows, group, block=block, sink=sl, **opts)
    (out * w[:, :, idx]).sum().backward()
    res = {"out": (out - out_ref[:, :, idx]).abs().max().item()}
    if sink is not None:  # each rank: its queries' (ring) or heads' (Ulysses) part, summed over the cp ranks
        torch.distributed.all_reduce(ds := sl.grad.clone(), group=group)
        res["dsink"] = (ds - sf.grad).abs().max().item()
    order = gathered_order(T, world)
    for name, got, ref in (("dq", ql, qf), ("dk", kl, kf), ("dv", vl, vf)):
        full = all_gather(got.grad, dim=2, group=group)  # gathered order
        res[name] = (full - ref.grad[:, :, order.to(device)]).abs().max().item()
    return res


CASES = [(case, mode, 4, 2) for case in ("causal", "packed", "uneven") for mode in ("ring", "ulysses")]
CASES += [("packed", mode, 4, 1) for mode in ("ring", "ulysses")]  # one kv head (< cp)
# blocks of 3 rows: many partial blocks merged by the log-sum-exp rule, cuts inside documents and chunks
CASES += [(case, mode, 4, 2, 3) for case in ("causal", "packed", "uneven") for mode in ("ring", "ulysses")]
# (case, mode, h, hkv, block, options): sliding windows shorter and longer than a shard, soft-capping (alone and
# with a window), the ring's all-gather form and a one-piece overlapped ring
OPTS = [
    (case, mode, 4, 2, 512, (("window", w),))
    for case in ("causal", "packed", "uneven")
    for mode in ("ring", "ulysses")
    for w in (3, 11)
]
OPTS += [
    ("packed", mode, 4, 2, 5, (("softcap", 2.0),) + w) for mode in ("ring", "ulysses") for w in ((), (("window", 6),))
]
OPTS += [("packed", "ring", 4, 2, 512, (("overlap", False),)), ("uneven", "ring", 4, 1, 512, (("pieces", 1),))]
# attention sinks (GPT-OSS's s_aux): alone, with a window, with soft-capping and a window (the blockwise fallback),
# in the ring's all-gather form
OPTS += [(case, mode, 4, 2, 512, (("sink", True),)) for case in ("causal", "packed") for mode in ("ring", "ulysses")]
OPTS += [("uneven", mode, 4, 1, 512, (("sink", True), ("window", 3))) for mode in ("ring", "ulysses")]
OPTS += [("packed", mode, 4, 2, 5, (("sink", True), ("softcap", 2.0), ("window", 6))) for mode in ("ring", "ulysses")]
OPTS += [("packed", "ring", 4, 2, 512, (("sink", True), ("overlap", False)))]


def _check_all(rank, world, device="cpu", dtype=torch.float64):
    """Every case in one set of ranks (a spawn costs seconds; the cases milliseconds).
    benchmarks/context_parallel/gpu_attention.py runs it on CUDA (gloo carries the CUDA tensors)."""
    res = {c: _check(rank, world, *c, device=device, dtype=dtype) for c in CASES}
    return res | {c: _check(rank, world, *c[:5], device=device, dtype=dtype, **dict(c[5])) for c in OPTS}


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_sdpa(world):
    """GQA 4 heads / 2 kv heads (fewer than cp at 4) and 1 kv head; forward and input gradients."""
    for per_rank in run_distributed(_check_all, world):
        for case, r in per_rank.items():
            assert max(r.values()) < 1e-10, (case, r)


def test_zigzag_layout_covers_each_position_once():
    for cp in (1, 2, 4):
        got = torch.cat([zigzag_indices(T, r, cp) for r in range(cp)])
        assert torch.equal(got.sort().values, torch.arange(T)) and torch.equal(got, gathered_order(T, cp))
    with pytest.raises(ValueError, match="not a multiple of 2 x cp_size = 8"):
        zigzag_indices(36, 0, 4)
