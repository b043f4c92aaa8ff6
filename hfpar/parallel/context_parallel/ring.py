"""Ring attention that overlaps: K / V pieces passed rank to rank while the current piece is computed.

    out = overlapped_ring_attention(q, k, v, rows, group, scaling, window, pieces=4)

Each rank keeps its queries (zigzag shard, layout.py). Its K / V shard is cut into `pieces` runs of tokens; in
step s = 0 .. cp-1 the rank attends to the pieces of rank (r - s) mod cp, and while it computes piece i it sends
that piece on to rank r + 1 and receives piece i of the next source from rank r - 1 (one
torch.distributed.batch_isend_irecv per piece: gloo and NCCL alike, running behind the kernel). Per rank, K / V
held at once: the own shard, plus at most the shard being worked through and one piece in flight, i.e.
O(T / cp) (T / cp x (1 + 1 / pieces) beyond the own shard), against T for the all-gather form
(blockwise.block_attention with a group, kept as the reference / fallback).

Each piece is computed by the fused kernel (fused.add_blocks: one call per document part, the merge by
log-sum-exp). Backward runs the ring again: K / V pieces travel as in forward and, one step behind them, the
partial dK / dV of each piece, to which every rank adds its share (the kernel's backward with the merged output
and log-sum-exp); after cp steps each partial sum arrives complete at the rank that owns the piece.
Communication per layer and rank: K, V (cp - 1) times forward, K, V (cp - 1) and dK, dV cp times backward, each
of T / cp tokens.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist

from ..comm import comm_stats, group_rank, group_size
from .fused import add_blocks, blocks_backward, new_state, row_calls, sink_backward, sink_factor
from .kernel_calls import segments
from .layout import RowLayout, zigzag_indices


def _bounds(n_tokens: int, pieces: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_tokens / pieces) for i in range(pieces + 1)]
    return [(a, b) for a, b in pairwise(cuts) if b > a]


def _exchange(send: list[torch.Tensor], recv_like: list[torch.Tensor], peers) -> tuple[list, list]:
    """Post sends of `send` to the next rank and receives shaped like `recv_like` from the previous one."""
    nxt, prv = peers
    send = [t.contiguous() for t in send]  # gloo / NCCL send contiguous buffers
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in recv_like]
    if comm_stats.enabled and send:
        comm_stats.record("send", sum(t.numel() * t.element_size() for t in send))
    ops = [dist.P2POp(dist.isend, t, nxt) for t in send] + [dist.P2POp(dist.irecv, t, prv) for t in bufs]
    return ((dist.batch_isend_irecv(ops) if ops else []), send), bufs  # the send buffers live until _wait


def _wait(handle) -> None:
    works, _ = handle if isinstance(handle, tuple) else (handle, None)
    for w in works:
        w.wait()


def _ring_layout(rows, group, local_len: int, pieces: int):
    """What forward and backward both walk: ring size and rank, (next, previous) global ranks, the K/V pieces'
    bounds, this rank's query segments, and every rank's zigzag token positions."""
    cp, r = group_size(group), group_rank(group)
    peers = (dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp))
    src_pos = [zigzag_indices(rows.doc.shape[1], j, cp) for j in range(cp)]
    return cp, r, peers, _bounds(local_len, pieces), segments(rows.local), src_pos


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows, group, scale, window, pieces, sink):
        cp, r, peers, bounds, q_segs, src_pos = _ring_layout(rows, group, k.shape[2], pieces)
        out, lse = new_state(q)
        hold = [(k[:, :, a:b], v[:, :, a:b]) for a, b in bounds]  # own pieces: contiguous copies when sent
        for s in range(cp):
            src = (r - s) % cp
            nxt = [None] * len(bounds)
            for i, (a, b) in enumerate(bounds):
                reqs = []
                if s < cp - 1:
                    reqs, nxt[i] = _exchange(list(hold[i]), list(hold[i]), peers)
                calls = row_calls(rows, q_segs, segments(src_pos[src][a:b]), window)
                add_blocks(out, lse, q, hold[i][0], hold[i][1], calls, scale)
                _wait(reqs)
                hold[i] = None  # this piece has been computed and passed on
            hold = nxt
        if sink is not None:  # attention sinks: the merged output's share (fused.sink_factor)
            out = out * sink_factor(lse, sink)[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.meta = (rows, group, scale, window, pieces)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        rows, group, scale, window, pieces = ctx.meta
        dsink = None
        if sink is not None:
            dout, dsink = sink_backward(dout, out, sink_factor(lse, sink), sink)
        dout = dout.contiguous()
        cp, r, peers, bounds, q_segs, src_pos = _ring_layout(rows, group, k.shape[2], pieces)
        acc = lse.dtype
        dq = torch.zeros_like(q, dtype=acc)
        hold = [(k[:, :, a:b], v[:, :, a:b]) for a, b in bounds]
        done = [None] * len(bounds)  # complete-so-far (dK, dV) of the last step's pieces
        for s in range(cp):
            src = (r - s) % cp
            nxt = [None] * len(bounds)
            for i, (a, b) in enumerate(bounds):
                send, like = [], []
                if s < cp - 1:
                    send, like = list(hold[i]), list(hold[i])
                if s > 0:  # last step's partial dK / dV on, this step's in
                    send += list(done[i])
                    like += list(done[i])
                reqs, bufs = _exchange(send, like, peers)
                dk = torch.zeros(hold[i][0].shape, dtype=acc, device=k.device)
                dv = torch.zeros(hold[i][1].shape, dtype=acc, device=v.device)
                calls = row_calls(rows, q_segs, segments(src_pos[src][a:b]), window)
                blocks_backward(dout, q, hold[i][0], hold[i][1], out, lse, calls, scale, dq, dk, dv)
                _wait(reqs)
                if s < cp - 1:
                    nxt[i], bufs = tuple(bufs[:2]), bufs[2:]
                if s > 0:
                    dk, dv = dk + bufs[0], dv + bufs[1]
                done[i], hold[i] = (dk, dv), None
            hold = nxt
        grads = []
        for i in range(len(bounds)):  # the complete sums go home: rank r + 1 owns them
            reqs, bufs = _exchange(list(done[i]), list(done[i]), peers)
            _wait(reqs)
            grads.append(bufs)
            done[i] = None
        dk = torch.cat([g[0] for g in grads], dim=2)
        dv = torch.cat([g[1] for g in grads], dim=2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsink


def overlapped_ring_attention(
    q, k, v, rows: RowLayout, group, scaling=None, window: int | None = None, pieces: int = 4, sink=None
) -> torch.Tensor:
    """(B, H, Tl, D) local queries; k, v (B, Hkv, Tl, D) this rank's shard -> (B, H, Tl, D); sink: (H,) logits."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return _Ring.apply(q, k, v, rows, group, scale, window, pieces, sink)
