"""Document-causal attention through the device's fused kernel, block by block, merged with the log-sum-exp.

    out = fused_attention(q, k, v, rows, q_pos, k_pos, scaling, window)   # k, v: the keys at k_pos (Ulysses)
    ring.py runs the same per-block steps (add_blocks / blocks_backward) on K / V pieces passed around the ring.

The kernel calls come from kernel_calls.py (one per document part of a block: no mask for blocks wholly in the causal
past, is_causal on the diagonal, a mask only where a sliding window cuts); padding queries attend to themselves
(out = v). Forward keeps q, k, v, the output and one log-sum-exp per query; backward calls the kernel's own
backward per block with the merged output and log-sum-exp (kernels.py). Attention sinks (one extra logit per head
in every query's softmax, no value: GPT-OSS) scale the merged output by sigmoid(lse - sink) (sink_factor;
sink_backward: the kernels' backward stays exact with no log-sum-exp gradient input). Exactness: the same softmax
as unsharded attention, in the kernel's accumulation order (float64 inputs stay float64 on CPU).
"""

from __future__ import annotations

import torch

from .kernel_calls import pair_calls, segments
from .kernels import attend, attend_backward
from .layout import RowLayout


def row_calls(rows: RowLayout, q_segs, k_segs, window) -> list[tuple[slice, list]]:
    """[(batch slice, ops), ...] for q_segs x k_segs: one list for all rows when their documents agree, else one
    per row. Cached on the RowLayout, so every layer of a forward (and backward) reuses it."""
    key = (tuple(q_segs), tuple(k_segs), window)
    if key not in rows.cache:
        docs = rows.doc_lists()
        if all(d == docs[0] for d in docs):
            rows.cache[key] = [(slice(None), pair_calls(docs[0], q_segs, k_segs, window))]
        else:
            rows.cache[key] = [(slice(b, b + 1), pair_calls(d, q_segs, k_segs, window)) for b, d in enumerate(docs)]
    return rows.cache[key]


def new_state(q: torch.Tensor):
    """(out, lse) accumulators: out in float32 at least, lse -inf (no key seen yet)."""
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], float("-inf"), dtype=acc)


def _self_block(q, k, v, scale):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    return v, (q.to(k.dtype) * k).sum(-1) * scale


def sink_factor(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention sinks (GPT-OSS's `s_aux`: one logit per head that every query's softmax also normalises over, with
    no value): the share of each query's softmax its keys keep, exp(lse) / (exp(lse) + exp(sink)) =
    sigmoid(lse - sink), from the log-sum-exp merged over all its keys. lse (B, H, T) or (B, Hkv, rep, T)."""
    return torch.sigmoid(lse - sink.to(lse.dtype).reshape(1, *lse.shape[1:-1], 1))


def sink_backward(dout: torch.Tensor, out: torch.Tensor, f: torch.Tensor, sink: torch.Tensor):
    """(dout for the kernels' backward, the sink's gradient) where `out` = out_keys * f is the sunk output. With
    dout * f and the sunk output, the kernels' delta = rowsum(dout * f * out) equals rowsum(dout * out_keys) minus
    the gradient that reaches the log-sum-exp through f, so their dq, dk, dv are exact without a log-sum-exp input."""
    acc = f.dtype
    dsink = -((dout.to(acc) * out.to(acc)).sum(-1) * (1 - f)).sum(0)  # (H, T) or (Hkv, rep, T)
    return dout * f[..., None].to(dout.dtype), dsink.sum(-1).reshape(sink.shape).to(sink.dtype)


def add_blocks(out, lse, q, k, v, calls, scale) -> None:
    """Merge the attention of q over the keys k, v (as the calls lay them out) into the running (out, lse)."""
    for b, ops in calls:
        for op in ops:
            qs, ks, vs = q[b, :, op.qa : op.qb], k[b, :, op.ka : op.kb], v[b, :, op.ka : op.kb]
            if op.kind == "self":
                o, blk = _self_block(qs, ks, vs, scale)
            else:
                o, blk = attend(qs, ks, vs, op.kind, op.mask, scale)
            cur, o_cur = lse[b, :, op.qa : op.qb], out[b, :, op.qa : op.qb]  # views: merged in place
            blk = blk.to(cur.dtype)
            # this block's share of the merged softmax, exp(blk - logaddexp(cur, blk)) = sigmoid(blk - cur): 1 for
            # queries no block has reached yet (cur = -inf); out <- out (1 - w) + o w in one pass (fewer kernels)
            o_cur.lerp_(o.to(o_cur.dtype), torch.sigmoid(blk - cur)[..., None])
            torch.logaddexp(cur, blk, out=cur)


def blocks_backward(dout, q, k, v, out, lse, calls, scale, dq, dk, dv) -> None:
    """Add this key set's share of the gradients to dq (local queries) and dk, dv (these keys)."""
    n = q.shape[1] // k.shape[1]
    for b, ops in calls:
        for op in ops:
            qsl, ksl = (b, slice(None), slice(op.qa, op.qb)), (b, slice(None), slice(op.ka, op.kb))
            if op.kind == "self":  # out = v (its own key only): dv; dq, dk only through an attention sink
                g = dout[qsl].to(dv.dtype)
                dv[ksl] += g if n == 1 else g.unflatten(1, (-1, n)).sum(2)
                kr, vr = (x[ksl].repeat_interleave(n, 1) if n > 1 else x[ksl] for x in (k, v))
                # the score's gradient p (dout . v - delta) with p = 1: zero unless a sink scaled out below v
                ds = (g * (vr.to(g.dtype) - out[qsl].to(g.dtype))).sum(-1, keepdim=True) * scale
                dq[qsl] += ds * kr.to(g.dtype)
                gk = ds * q[qsl].to(g.dtype)
                dk[ksl] += gk if n == 1 else gk.unflatten(1, (-1, n)).sum(2)
                continue
            gq, gk, gv = attend_backward(dout[qsl], q[qsl], k[ksl], v[ksl], out[qsl], lse[qsl], op.kind, op.mask, scale)
            dq[qsl] += gq
            dk[ksl] += gk
            dv[ksl] += gv


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, calls, scale, sink):
        out, lse = new_state(q)
        add_blocks(out, lse, q, k, v, calls, scale)
        if sink is not None:
            out = out * sink_factor(lse, sink)[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.meta = (calls, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        calls, scale = ctx.meta
        dsink = None
        if sink is not None:
            dout, dsink = sink_backward(dout, out, sink_factor(lse, sink), sink)
        dq, dk, dv = (torch.zeros_like(x, dtype=lse.dtype) for x in (q, k, v))
        blocks_backward(dout.contiguous(), q, k, v, out, lse, calls, scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsink


def fused_attention(q, k, v, rows: RowLayout, q_pos, k_pos, scaling=None, window: int | None = None, sink=None):
    """Attention of the queries at global positions q_pos over the keys at k_pos (both on this rank) ->
    (B, H, Tq, D), document-causal per rows.doc, within `window` when given; sink: (H,) attention-sink logits."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    calls = row_calls(rows, segments(q_pos), segments(k_pos), window)
    return _FusedAttention.apply(q, k, v, calls, scale, sink)
