"""One attention layer of a packed step, forward + backward: sdpa over rows of --row_len tokens with the block-diagonal
mask (what hfpar's default padding-free rows and --packing run) against hfpar_varlen over the same samples joined
into ONE row (hfpar.train.varlen: torch's FlashAttention-2 varlen kernel on CUDA in bf16, per-sample SDPA on CPU).

    python -m benchmarks.varlen.attention                     # CUDA: Llama-3.2-3B's attention (24 / 8 heads x 128)
    python -m benchmarks.varlen.attention --device cpu --heads 8 --kv_heads 2 --rows 2 --row_len 2048 --dtype float32

The samples' lengths are drawn (seeded) from a log-normal around --mean_len tokens and packed first-fit into --rows
rows, the same samples in both layouts; the rows' padding (to the longest row) is computed by sdpa and not by
varlen. Timed: the median of --repeats calls of transformers' attention function (q / k / v given, grads of all
three), after a warm-up; peak memory on CUDA. Both outputs are compared (max abs difference over the real tokens).
Writes OUT/<device>.json and OUT/<device>.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import find_packed_sequence_indices

from hfpar.data.collate import first_fit_decreasing
from hfpar.train.varlen import varlen_attention_forward


def layout(a) -> tuple[list[list[int]], list[int]]:
    """(rows of sample lengths, every length), seeded."""
    rng = random.Random(a.seed)
    budget, lengths = a.rows * a.row_len, []
    while True:
        n = min(a.row_len, max(8, int(rng.lognormvariate(math.log(a.mean_len), 0.8))))
        if sum(lengths) + n > budget * 0.95:
            break
        lengths.append(n)
    bins = first_fit_decreasing(lengths, a.row_len)
    return [[lengths[i] for i in b] for b in bins], lengths


def positions(rows: list[list[int]], length: int) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=torch.long)  # padding: position 0, a one-token sample each
    for r, row in enumerate(rows):
        out[r, : sum(row)] = torch.cat([torch.arange(n) for n in row])
    return out


def timed(fn, a, sync) -> tuple[float, float]:
    """(median seconds, peak bytes) of fn() (forward + backward)."""
    for _ in range(a.warmup):
        fn()
    sync()
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if a.device == "cuda" else float("nan")
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--row_len", type=int, default=4096)
    p.add_argument("--mean_len", type=int, default=600)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/varlen")
    a = p.parse_args()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rows, lengths = layout(a)
    longest = max(sum(r) for r in rows)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=a.heads // a.kv_heads, training=True)
    g = torch.Generator().manual_seed(a.seed)
    total = sum(lengths)

    def qkv(shape_b, t):
        return [
            torch.randn(shape_b, h, t, a.head_dim, generator=g).to(dev, dtype).requires_grad_()
            for h in (a.heads, a.kv_heads, a.kv_heads)
        ]

    packed_pos = positions(rows, longest).to(dev)
    mask_pos = find_packed_sequence_indices(packed_pos)  # (B, T) sample index: the block-diagonal causal mask
    same = mask_pos[:, :, None] == mask_pos[:, None, :]
    mask = (same & torch.ones(longest, longest, dtype=torch.bool, device=dev).tril())[:, None]  # (B, 1, T, T)
    q1, k1, v1 = qkv(len(rows), longest)
    one_pos = torch.cat([packed_pos[r, : sum(row)] for r, row in enumerate(rows)])[None]
    # the one row: each packed row's real tokens, in order (the same q / k / v values)
    q2, k2, v2 = (
        torch.cat([x.detach()[r, :, : sum(row)] for r, row in enumerate(rows)], dim=1)[None].requires_grad_()
        for x in (q1, k1, v1)
    )
    scale = a.head_dim**-0.5

    def run_sdpa():
        out, _ = sdpa_attention_forward(module, q1, k1, v1, mask, scaling=scale)
        out.sum().backward()
        return out

    def run_varlen():
        out, _ = varlen_attention_forward(module, q2, k2, v2, None, scaling=scale, position_ids=one_pos)
        out.sum().backward()
        return out

    with torch.no_grad():
        a_out = sdpa_attention_forward(module, q1, k1, v1, mask, scaling=scale)[0]
        b_out = varlen_attention_forward(module, q2, k2, v2, None, scaling=scale, position_ids=one_pos)[0]
        a_real = torch.cat([a_out[r, : sum(row)] for r, row in enumerate(rows)])
        diff = float((a_real.float() - b_out[0].float()).abs().max())
    t_sdpa, m_sdpa = timed(run_sdpa, a, sync)
    t_var, m_var = timed(run_varlen, a, sync)
    result = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "args": vars(a),
        "samples": len(lengths),
        "tokens": total,
        "rows": [sum(r) for r in rows],
        "sdpa_s": t_sdpa,
        "varlen_s": t_var,
        "speedup": t_sdpa / t_var,
        "sdpa_peak_bytes": m_sdpa,
        "varlen_peak_bytes": m_var,
        "max_abs_diff": diff,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = a.device
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    mib = lambda b: "-" if math.isnan(b) else f"{b / 2**20:.0f}"  # noqa: E731
    md = (
        f"`python -m benchmarks.varlen.attention {' '.join(sys.argv[1:])}`\n\n"
        f"{result['device']}, {a.dtype}, {a.heads} / {a.kv_heads} heads x {a.head_dim}, {len(lengths)} samples "
        f"({total} tokens) in rows of <= {a.row_len} ({', '.join(map(str, result['rows']))})\n\n"
        "| attention (forward + backward) | median ms | peak MiB |\n|---|---|---|\n"
        f"| sdpa, {len(rows)} rows, block-diagonal mask | {1e3 * t_sdpa:.2f} | {mib(m_sdpa)} |\n"
        f"| hfpar_varlen, one row | {1e3 * t_var:.2f} | {mib(m_var)} |\n\n"
        f"speed-up {result['speedup']:.2f}x; outputs differ by at most {diff:.1e}\n"
    )
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
