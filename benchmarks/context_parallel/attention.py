"""Context-parallel attention alone: forward + backward time per rank and working memory, against SDPA.

    python -m benchmarks.context_parallel.scaling attention [T ...]   # -> results/context_parallel/attention_cpu.*

fp32, B=1, H=8 heads, 8 kv heads, D=64, one row of T tokens; every process (the one-process baseline and each cp
rank) runs with one intra-op thread, so a cp rank stands for one device. Per T:
  sdpa     F.scaled_dot_product_attention(is_causal=True) over the whole row in one process (the baseline), timed
           by rank 0 alone between the cp runs (the machine may be shared: both see the same load);
  cp=1..4  hfpar's ring (overlapped, fused kernel per block) and Ulysses on gloo ranks, on a single-document row
           and on a packed row (documents of 1/8 .. 3/8 of T, seeded): the time of the slowest rank, best of 2.
Working memory: the peak of the bytes allocated inside attention forward + backward on rank 0 beyond its inputs
(torch.profiler's memory events), overlapped ring against the all-gather form (overlap=False), packed row.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.launch import run_ranks
from hfpar.parallel.context_parallel import (
    ring_attention,
    shard_batch,
    ulysses_attention,
    zigzag_indices,
)

H, HKV, D = 8, 8, 64


def packed_positions(seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq_len)
    parts, left = [], seq_len
    while left:
        n = min(left, int(torch.randint(seq_len // 8, 3 * seq_len // 8 + 1, (1,), generator=g)))
        parts.append(torch.arange(n))
        left -= n
    return torch.cat(parts)[None]


def _inputs(seq_len: int, packed: bool, rank: int, cp: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, seq_len, D, generator=g) for n in (H, HKV, HKV))
    pos = packed_positions(seq_len) if packed else torch.arange(seq_len)[None]
    _, rows = shard_batch({"input_ids": torch.zeros(1, seq_len, dtype=torch.long), "position_ids": pos}, rank, cp)
    idx = zigzag_indices(seq_len, rank, cp)
    return [x[:, :, idx].contiguous().requires_grad_() for x in (q, k, v)], rows


def _peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


def _rank(rank: int, world: int, seq_len: int, mode: str, packed: bool, memory: bool) -> dict:
    torch.set_num_threads(1)
    (q, k, v), rows = _inputs(seq_len, packed, rank, world)
    # the ranks wait at a barrier while rank 0 times SDPA: on a loaded machine that takes longer than the default
    # group's 120 s timeout, hence a group of the same ranks with an hour's
    group = dist.new_group(list(range(world)), timeout=timedelta(hours=1))
    fn = ring_attention if mode.startswith("ring") else ulysses_attention
    opts = {"overlap": False} if mode == "ring_allgather" else {}

    def step():
        out = fn(q, k, v, rows, group, **opts)
        out.backward(torch.ones_like(out))

    if memory:
        step()  # warm-up (kernel calls cached on rows)
        dist.barrier(group)
        return {"peak_bytes": _peak_bytes(step)}
    best, base, cpu, base_cpu = (float("inf"),) * 4
    for _ in range(2):  # the baseline interleaved with the cp runs: the same machine load for both (it is shared)
        dist.barrier(group)
        if rank == 0:
            wall, proc = sdpa_seconds(seq_len, repeats=1, cpu=True)
            base, base_cpu = min(base, wall), min(base_cpu, proc)
        dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the slowest rank
        best, cpu = min(best, dt[0].item()), min(cpu, dt[1].item())
    return {"seconds": best, "sdpa_seconds": base, "cpu_seconds": cpu, "sdpa_cpu_seconds": base_cpu}


def sdpa_seconds(seq_len: int, repeats: int = 2, cpu: bool = False):
    """Best wall seconds of SDPA causal forward + backward over the whole row, one thread (cpu=True: (wall, CPU
    seconds of this process), each the best of the repeats)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, seq_len, D, generator=g).requires_grad_() for _ in range(3))
    best = best_cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return (best, best_cpu) if cpu else best


def measure(lengths, cps=(1, 2, 4), progress=None) -> dict:
    """Every row and (when cp=4 is measured) the memory figures, with the machine's load average before and after
    (it may be shared); progress: a path the rows so far are written to after each one."""
    rows, memory = [], []
    load = {
        "start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for seq_len in lengths:
        for cp in cps:
            for mode in ("ring", "ulysses") if cp > 1 else ("ring",):
                for packed in (False, True) if cp > 1 else (False,):
                    r = run_ranks(_rank, cp, seq_len, mode, packed, False, timeout=3000)[0]
                    rows.append(
                        {
                            "seq_len": seq_len,
                            "cp": cp,
                            "mode": mode,
                            "row": "packed" if packed else "single",
                            **r,
                            "vs_sdpa": r["seconds"] / r["sdpa_seconds"],
                            "cpu_vs_sdpa": r["cpu_seconds"] / r["sdpa_cpu_seconds"],
                        }
                    )
                    print(rows[-1], flush=True)
                    if progress is not None:
                        progress.write_text(json.dumps({"rows": rows, "load": load}, indent=2))
    longest = max(lengths)
    for mode in ("ring", "ring_allgather") if 4 in cps else ():
        r = run_ranks(_rank, 4, longest, mode, True, True, timeout=3000)[0]
        memory.append({"seq_len": longest, "cp": 4, "mode": mode, **r})
        print(memory[-1], flush=True)
    load["end"] = os.getloadavg()
    return {"rows": rows, "memory": memory, "load": load}


def report(res: dict) -> list[str]:
    md = [
        "# Context-parallel attention (CPU, gloo, fp32, one thread per process)",
        "",
        (
            "Command: `python -m benchmarks.context_parallel.scaling attention "
            + " ".join(str(t) for t in sorted({r["seq_len"] for r in res["rows"]}))
            + (
                ""
                if (cps := sorted({r["cp"] for r in res["rows"]})) == [1, 2, 4]
                else f" --cp {','.join(map(str, cps))}"
            )
            + "` (B=1, H=8, 8 kv heads, D=64; forward + backward of the attention alone; cp ranks: the slowest rank, "
            "best of 2; sdpa: one process, whole row, timed between the cp runs; CPU: the process's CPU seconds, "
            "less sensitive than wall time to other work on the machine)"
        ),
        "",
    ]
    if "load" in res:
        ld = res["load"]
        md += [
            f"{ld['date']}, {ld['cpus']} CPUs; load average (1, 5, 15 min) at the start "
            f"{', '.join(f'{x:.1f}' for x in ld['start'])}, at the end {', '.join(f'{x:.1f}' for x in ld['end'])}"
            + (
                " (the machine was shared: other processes ran beside this benchmark)"
                if max(ld["start"][0], ld["end"][0]) > 0.5 * ld["cpus"]
                else ""
            ),
            "",
        ]
    md += [
        (
            "| T | cp | mode | row | seconds per rank | SDPA whole row, seconds | ratio | CPU s per rank | SDPA CPU s "
            "| CPU ratio |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        md.append(
            f"| {r['seq_len']} | {r['cp']} | {r['mode']} | {r['row']} | {r['seconds']:.3f} | "
            f"{r['sdpa_seconds']:.3f} | {r['vs_sdpa']:.2f} | {r.get('cpu_seconds', float('nan')):.3f} | "
            f"{r.get('sdpa_cpu_seconds', float('nan')):.3f} | {r.get('cpu_vs_sdpa', float('nan')):.2f} |"
        )
    md += [""]
    by = {(r["seq_len"], r["cp"], r["mode"], r["row"]): r for r in res["rows"]}
    for (t, cp, mode, row), r in by.items():  # the acceptance: cp=2 <= 0.6x SDPA at 8k+, packed <= 1.3x single
        if cp == 2 and row == "single" and t >= 8192 and (t, 2, mode, "packed") in by:
            p = by[t, 2, mode, "packed"]
            md.append(
                f"T={t}, cp=2 {mode}: single-document row {r['vs_sdpa']:.2f}x SDPA (CPU {r['cpu_vs_sdpa']:.2f}x), "
                f"packed row {p['vs_sdpa']:.2f}x (CPU {p['cpu_vs_sdpa']:.2f}x); packed / single "
                f"{p['seconds'] / r['seconds']:.2f} (CPU {p['cpu_seconds'] / r['cpu_seconds']:.2f})."
            )
    m = {r["mode"]: r["peak_bytes"] for r in res["memory"]}
    md += (
        []
        if not m
        else [
            "",
            (
                f"Working memory of attention forward + backward on rank 0 at cp=4, T={res['memory'][0]['seq_len']}, "
                f"packed row (peak bytes allocated beyond the inputs): overlapped ring {m['ring'] / 1e6:.1f} MB, "
                "all-gather "
                f"form {m['ring_allgather'] / 1e6:.1f} MB, ratio {m['ring'] / m['ring_allgather']:.2f}."
            ),
        ]
    )
    return md


def plot(res: dict, path) -> None:
    import matplotlib  # an optional extra, for the plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sdpa = sorted({r["seq_len"]: r["sdpa_seconds"] for r in res["rows"] if r["cp"] == 2}.items())
    ax.plot(*zip(*sdpa), "k-o", label="SDPA, one process, whole row")
    for (cp, mode, row), style in {
        (1, "ring", "single"): "m-o",
        (2, "ring", "single"): "b-o",
        (2, "ring", "packed"): "b:^",
        (2, "ulysses", "single"): "c--s",
        (4, "ring", "single"): "g-o",
        (4, "ring", "packed"): "g:^",
        (4, "ulysses", "single"): "y--s",
    }.items():
        pts = [(r["seq_len"], r["seconds"]) for r in res["rows"] if (r["cp"], r["mode"], r["row"]) == (cp, mode, row)]
        ax.plot(*zip(*pts), style, label=f"cp={cp} {mode} {row}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("attention fwd + bwd seconds per rank")
    ax.set_title("context-parallel attention vs SDPA (CPU, fp32)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
