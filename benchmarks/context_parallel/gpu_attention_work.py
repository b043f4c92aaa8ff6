"""What benchmarks/context_parallel/gpu_attention.py times and checks: rows of packed documents, one cp rank's share of
them, and the kernels' calls for that share.

    pos = positions(4096, "packed", seed=0)             # (T,) position ids: documents restart at 0
    work = RankWork(rows, 4096, rank=0, cp=2, pieces=2)  # rank 0's ring compute, in the ring's pieces
    ms, mib = timed("cuda", fn, reps=10)                # ms per call, peak MiB beyond what was allocated
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.nn.functional as F

from hfpar.parallel.context_parallel import shard_batch, zigzag_indices
from hfpar.parallel.context_parallel.fused import (
    add_blocks,
    blocks_backward,
    new_state,
    row_calls,
)
from hfpar.parallel.context_parallel.kernel_calls import segments
from hfpar.parallel.context_parallel.ring import (
    _bounds,  # (the ring's own cut of a shard in pieces)
)


def timed(dev: str, fn, reps: int) -> tuple[float, float | None]:
    """(ms per call, peak MiB allocated beyond what was allocated before; None on CPU) of fn(), after 2 warm-ups."""
    for _ in range(2):
        fn()
    if dev == "cpu":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**20


def positions(t: int, row: str, seed: int) -> torch.Tensor:
    """(T,) position ids: 0..T-1 (single) or documents one after another (packed: T/8 .. 3T/8, packed_1k: 256 ..
    1792 tokens; the last one cut at T)."""
    if row == "single":
        return torch.arange(t)
    lo, hi = (t // 8, 3 * t // 8) if row == "packed" else (256, 1792)
    g = torch.Generator().manual_seed(seed)
    parts, left = [], t
    while left:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=g)))
        parts.append(torch.arange(n))
        left -= n
    return torch.cat(parts)


def layout(pos: torch.Tensor, rank: int, cp: int, dev: str, mask: torch.Tensor | None = None):
    """hfpar's RowLayout of rows with these (B, T) position ids (and attention mask), for `rank` of `cp`."""
    batch = {"input_ids": torch.zeros(pos.shape, dtype=torch.long, device=dev), "position_ids": pos.to(dev)}
    if mask is not None:
        batch["attention_mask"] = mask.to(dev)
    return shard_batch(batch, rank, cp)[1]


class RankWork:
    """Rank `rank`'s ring compute at cp: queries q (B, H, T/cp, D) against every K / V shard, in the ring's pieces.
    kv[src] = (k, v) of rank src's shard (B, Hkv, T/cp, D). Mirrors ring._Ring forward and backward, no transfers."""

    def __init__(self, rows, t: int, rank: int, cp: int, pieces: int, window=None):
        self.rows, self.scale = rows, None
        q_segs = segments(rows.local)
        bounds = _bounds(t // cp, pieces)
        src_pos = [zigzag_indices(t, j, cp) for j in range(cp)]
        self.steps = []  # (src, a, b, calls) in ring order
        for s in range(cp):
            src = (rank - s) % cp
            for a, b in bounds:
                self.steps.append((src, a, b, row_calls(rows, q_segs, segments(src_pos[src][a:b]), window)))

    def __call__(self, q, kv, dout):
        """(out, dq, {src: (dk, dv)}) of forward then backward, as the ring computes them."""
        scale = q.shape[-1] ** -0.5
        out, lse = new_state(q)
        pieces = {
            (src, a): (kv[src][0][:, :, a:b].contiguous(), kv[src][1][:, :, a:b].contiguous())
            for src, a, b, _ in self.steps
        }  # received ring pieces are contiguous buffers
        for src, a, b, calls in self.steps:
            add_blocks(out, lse, q, *pieces[src, a], calls, scale)
        out = out.to(q.dtype)
        dq = torch.zeros_like(q, dtype=lse.dtype)
        grads = {}
        for src, a, b, calls in self.steps:
            kp, vp = pieces[src, a]
            dk, dv = (torch.zeros_like(x, dtype=lse.dtype) for x in (kp, vp))
            blocks_backward(dout, q, kp, vp, out, lse, calls, scale, dq, dk, dv)
            grads[src, a, b] = (dk, dv)
        return out, dq, grads


def varlen_fn(q, k, v, pos):
    """torch's varlen_attn over the documents of a (1, H, T, D) row, or None when not importable here."""
    try:
        from torch.nn.attention.varlen import (
            varlen_attn,  # optional: not in every torch build (noqa: I001)
        )
    except ImportError:
        return None
    starts = torch.ones(pos.numel(), dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    lens = torch.diff(torch.cat([torch.nonzero(starts).flatten(), torch.tensor([pos.numel()])]))
    cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32).to(q.device)
    mx, h, hkv = int(lens.max()), q.shape[1], k.shape[1]
    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def run():
        kk, vv = (k, v) if gqa else (k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))
        qf, kf, vf = (x[0].transpose(0, 1) for x in (q, kk, vv))  # (T, heads, D)
        return varlen_attn(qf, kf, vf, cu, cu, mx, mx, **kw).transpose(0, 1)[None]

    return run
