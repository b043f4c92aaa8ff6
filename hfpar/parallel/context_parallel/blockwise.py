"""Exact document-causal attention computed block by block with the online-softmax (log-sum-exp) rule, in plain
torch ops: the reference the fused-kernel path (fused.py, ring.py) is tested against, the named fallback for
logit soft-capping (no fused kernel applies it), and the ring's all-gather form (ring_attention(overlap=False)).

    out = block_attention(q, k, v, doc, q_pos, k_pos, scaling)            # k, v: the whole row (Ulysses)
    out = block_attention(q, k_local, v_local, doc, q_pos, k_pos, scaling, group=cp_group)   # ring

The score blocks are transient: forward keeps q, k, v (the local shards only, under a group), the output and one
log-sum-exp per query, like flash attention; backward recomputes each block's probabilities from them.
why: docs/architecture.md#why-the-parallel-layers

With a group (ring attention in its all-gather form, as Llama 3's context parallelism): K and V of the whole row
are all-gathered in forward and again in backward (not kept), dK and dV are reduce-scattered back to their ranks.
Blocks in which no query may attend any key (the future of a causal row, other documents) are skipped.

Shapes: q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with H a multiple of Hkv (GQA: query head h reads kv head h // (H /
Hkv), transformers' repeat_kv order) - the kv heads are never repeated in memory. doc (B, T) document id per global
position (-1 padding); q_pos (Tq,), k_pos (Tk,) the global positions of the query and key rows. A padding query
attends to itself only, so every query has at least one key and the log-sum-exp is finite.
"""

from __future__ import annotations

import torch

from ..comm import all_gather, group_size, reduce_scatter
from .fused import sink_backward, sink_factor

BLOCK = 512  # query and key rows per block: (B, H, 512, 512) fp32 scores = 1 MiB per batch row and head


def doc_causal_mask(
    doc: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """(B, 1, Tq, Tk) True where query position q_pos[i] may attend key position k_pos[j]: same document, key not
    after the query (and within `window`: q - window < k); a padding query (doc -1) attends to itself only."""
    dq, dk = doc[:, q_pos], doc[:, k_pos]  # (B, Tq), (B, Tk)
    same = (dq[:, :, None] == dk[:, None, :]) & (dq[:, :, None] >= 0)  # (B, Tq, Tk)
    causal = k_pos[None, None, :] <= q_pos[None, :, None]  # (1, Tq, Tk)
    if window is not None:
        causal = causal & (k_pos[None, None, :] > q_pos[None, :, None] - window)
    self_pad = (dq[:, :, None] < 0) & (k_pos[None, None, :] == q_pos[None, :, None])
    return ((same & causal) | self_pad)[:, None]


def _blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, doc: torch.Tensor, size: int, window):
    """(query slice, key slice, (B, 1, 1, tq, tk) mask) for every block holding at least one allowed pair."""
    for qa in range(0, q_pos.numel(), size):
        qs = slice(qa, qa + size)
        for ka in range(0, k_pos.numel(), size):
            ks = slice(ka, ka + size)
            mask = doc_causal_mask(doc, q_pos[qs], k_pos[ks], window)
            if mask.any():
                yield qs, ks, mask[:, :, None]


def _scores(q5, k, qs, ks, mask, scale, acc, softcap=None):
    """Masked scores of one block: (B, Hkv, rep, tq, tk) in the accumulation dtype, and d(scores) / d(q k scale)
    (1 - tanh^2 under logit soft-capping, Gemma 2's cap * tanh(s / cap); else None)."""
    s = q5[..., qs, :].to(acc) @ k[:, :, None, ks].to(acc).transpose(-1, -2) * scale
    grad = None
    if softcap:
        t = torch.tanh(s / softcap)
        s, grad = t * softcap, 1 - t * t
    return s.masked_fill(~mask, float("-inf")), grad


def _not_inf(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x.isneginf(), 0.0)


def _forward(q5, k, v, doc, q_pos, k_pos, scale, size, acc, window, softcap):
    out = q5.new_zeros(q5.shape, dtype=acc)
    lse = q5.new_full(q5.shape[:-1], float("-inf"), dtype=acc)  # (B, Hkv, rep, Tq)
    for qs, ks, mask in _blocks(q_pos, k_pos, doc, size, window):
        s, _ = _scores(q5, k, qs, ks, mask, scale, acc, softcap)
        blk_lse = torch.logsumexp(s, dim=-1)  # -inf: no key of this block
        o = torch.exp(s - _not_inf(blk_lse)[..., None]) @ v[:, :, None, ks].to(acc)
        new = torch.logaddexp(lse[..., qs], blk_lse)
        base = _not_inf(new)
        out[..., qs, :] = (
            out[..., qs, :] * torch.exp(lse[..., qs] - base)[..., None] + o * torch.exp(blk_lse - base)[..., None]
        )
        lse[..., qs] = new
    return out, lse


def _backward(dout, q5, k, v, out, lse, doc, q_pos, k_pos, scale, size, acc, window, softcap):
    dout = dout.to(acc)
    delta = (dout * out.to(acc)).sum(-1)  # (B, Hkv, rep, Tq)
    dq = torch.zeros_like(q5, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    for qs, ks, mask in _blocks(q_pos, k_pos, doc, size, window):
        s, cap_grad = _scores(q5, k, qs, ks, mask, scale, acc, softcap)
        p = torch.exp(s - lse[..., qs, None])  # masked -> 0
        do = dout[..., qs, :]
        dv[:, :, ks] += (p.transpose(-1, -2) @ do).sum(2)
        ds = p * (do @ v[:, :, None, ks].to(acc).transpose(-1, -2) - delta[..., qs, None])
        if cap_grad is not None:
            ds = ds * cap_grad
        dq[..., qs, :] += ds @ k[:, :, None, ks].to(acc) * scale
        dk[:, :, ks] += (ds.transpose(-1, -2) @ q5[..., qs, :].to(acc)).sum(2) * scale
    return dq, dk, dv


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, q_pos, k_pos, scale, size, group, window, softcap, sink):
        b, h, tq, d = q.shape
        hkv = k.shape[1]
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        q5 = q.reshape(b, hkv, h // hkv, tq, d)
        kf, vf = (k, v) if group is None else (all_gather(k, 2, group), all_gather(v, 2, group))
        out, lse = _forward(q5, kf, vf, doc, q_pos, k_pos, scale, size, acc, window, softcap)
        if sink is not None:  # attention sinks (fused.sink_factor); lse (B, Hkv, rep, Tq)
            out = out * sink_factor(lse, sink)[..., None]
        out = out.to(q.dtype).reshape(b, h, tq, d)
        ctx.save_for_backward(q, k, v, out, lse, doc, q_pos, k_pos, sink)
        ctx.meta = (scale, size, group, acc, window, softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc, q_pos, k_pos, sink = ctx.saved_tensors
        scale, size, group, acc, window, softcap = ctx.meta
        b, h, tq, d = q.shape
        hkv = k.shape[1]
        kf, vf = (k, v) if group is None else (all_gather(k, 2, group), all_gather(v, 2, group))
        shape5 = (b, hkv, h // hkv, tq, d)
        dout, dsink = dout.reshape(shape5), None
        if sink is not None:
            dout, dsink = sink_backward(dout, out.reshape(shape5), sink_factor(lse, sink), sink)
        dq, dk, dv = _backward(
            dout,
            q.reshape(shape5),
            kf,
            vf,
            out.reshape(shape5),
            lse,
            doc,
            q_pos,
            k_pos,
            scale,
            size,
            acc,
            window,
            softcap,
        )
        if group is not None:
            dk, dv = reduce_scatter(dk, 2, group), reduce_scatter(dv, 2, group)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 8), dsink


def block_attention(
    q,
    k,
    v,
    doc,
    q_pos,
    k_pos,
    scaling=None,
    *,
    group=None,
    block: int = BLOCK,
    window: int | None = None,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document-causal attention of queries at global positions q_pos over keys at k_pos -> (B, H, Tq, D).
    With `group`, k and v are this rank's shards and k_pos the positions of their all-gather (rank order).
    window: sliding window (key visible when q - window < k <= q); softcap: logit soft-capping (Gemma 2); sink: (H,)
    attention-sink logits (GPT-OSS's s_aux)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    if group is not None and group_size(group) == 1:
        group = None
    return _BlockAttention.apply(q, k, v, doc, q_pos, k_pos, scale, block, group, window, softcap, sink)
