"""MoE block speed at ep = 1, 2, 4 on CPU (gloo ranks): hfpar vs transformers on the same tokens, all-to-all bytes.

    python -m benchmarks.moe.ep_cpu       # writes benchmarks/results/moe/ep_cpu.{json,md,png}; ~10 min on 2 busy cores

Shapes (shapes.py, scale "cpu", fp32): Qwen3-30B-A3B's layer (H 2048, 128 experts, top-8, softmax router) and
DeepSeek-V3's (256 experts, top-8, 1 shared expert, sigmoid router with e_score_correction_bias, 8 groups / top-4
groups, routed scaling 2.5), both with their experts narrowed (--qwen3_intermediate, default 192 of 768;
DeepSeek H 1024 of 7168 and --dsv3_intermediate, default 128 of 2048) and --tokens per rank, to fit minutes of two
shared cores and a few GiB. Every rank builds the same layer (same seed) and draws its own tokens.

At each ep (a fresh set of ep gloo ranks, --threads torch threads each), every rank times, interleaved round by round
(so load from other processes hits all variants alike): transformers' block on its own tokens with each experts
implementation (eager, grouped_mm, batched_mm where its per-copy weight gather stays under --batched_mm_gib; at ep > 1
the one that was fastest at ep = 1) and hfpar's block after apply_expert_parallel over the ep ranks, on the same
tokens (forward + backward of the block alone, median of --rounds after --warmup). A step's time is the slowest
rank's. ep = 1: Qwen3-MoE runs hfpar's MoELayer (GroupedExperts); DeepSeek-V3 keeps transformers' block (its
router, shared expert and combine) with its experts on hfpar's CPU kernel (hf_experts.speed_up_hf_experts); at
ep > 1 both run hfpar's kernel on each rank's experts. Where the kernel's gain comes from (expert_parallel/kernels.py):
its backward reuses the experts' weight-gradient buffer where transformers' grouped_mm faults in fresh memory for
it every step (the benchmark, like training, sets .grad to None after each step).
Before timing, hfpar's output and input gradient are compared with transformers' on the same tokens (max over ranks).

All-to-all bytes: hfpar's comm counter (hfpar.observe.comm_stats.CommCounter, the trainer's --log_comm_bytes: the
all-to-all bytes each rank addresses to OTHER ranks) over one forward + backward, against the routed-token minimum
computed independently from transformers' router on the same tokens: the copies this rank sends to experts on other
ranks plus the copies it receives for its own experts, each crossing once in dispatch and once in combine, forward and
backward: 2 x (sent + received) x H x 4 bytes. The per-expert count exchange (E int64 per forward) comes on top and is
shown apart. Timings on this shared machine are inflated by other processes' load; the ratios within one run are the
result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common.launch import command, results_dir, run_ranks
from benchmarks.moe.shapes import (
    batched_mm_bytes,
    build_model,
    describe,
    layer_config,
    moe_block,
    step_block,
)
from hfpar.observe.comm_stats import CommCounter
from hfpar.parallel.expert_parallel import apply_expert_parallel

RESULTS = results_dir("moe")
IMPLS = ("eager", "grouped_mm", "batched_mm")


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _max(v: float, ep: int) -> float:
    if ep == 1:
        return v
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sum(v: int, ep: int) -> int:
    if ep == 1:
        return v
    t = torch.tensor([v], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t[0])


def routed_minimum(hf_block, x: torch.Tensor, ep: int, rank: int) -> dict:
    """Token copies this rank sends to other ranks' experts and receives for its own, from transformers' router."""
    with torch.no_grad():
        _, _, idx = hf_block.gate(x.reshape(-1, x.shape[-1]))  # (N, k) expert ids
    E = hf_block.experts.gate_up_proj.shape[0]
    counts = torch.bincount(idx.reshape(-1), minlength=E)  # (E,) copies per expert, this rank
    owner = torch.arange(E) // (E // ep)  # (E,) the rank holding each expert
    every = [torch.zeros_like(counts) for _ in range(ep)]
    if ep > 1:
        dist.all_gather(every, counts)
    else:
        every = [counts]
    sent = int(counts[owner != rank].sum())
    received = sum(int(c[owner == rank].sum()) for r, c in enumerate(every) if r != rank)
    load = torch.stack(every).sum(0).double()
    return {"sent_rows": sent, "received_rows": received, "max_over_mean_expert_load": float(load.max() / load.mean())}


def run_shape(shape: str, a, ep: int, rank: int, best_impl: str | None) -> dict:
    cfg = layer_config(shape, a.scale, **a.overrides[shape])
    hf_model = build_model(cfg, "cpu", torch.float32)
    ep_model = build_model(cfg, "cpu", torch.float32)
    hf = moe_block(hf_model)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, a.tokens // 2, cfg.hidden_size, generator=g)  # this rank's tokens
    apply_expert_parallel(ep_model, dist.group.WORLD if ep > 1 else None)
    ours = moe_block(ep_model)
    row = {"shape": describe(cfg), "tokens_per_rank": a.tokens, "ep": ep}
    # exactness on the same tokens: output and input gradient
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    hf_model.set_experts_implementation("grouped_mm")
    want, got = _out(hf(xs[0])), _out(ours(xs[1]))
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(7 + rank))
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    row["rel_diff_output"] = _max(_rel(got, want), ep)
    row["rel_diff_input_grad"] = _max(_rel(xs[1].grad, xs[0].grad), ep)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    # bytes: one forward + backward under the comm counter, and the routed-token minimum
    m = routed_minimum(hf, x, ep, rank)
    counter = CommCounter().install()
    try:
        step_block(ours, x)
    finally:
        counter.uninstall()
    a2a = int(counter.snapshot().get("all_to_all", {}).get("wire", 0))  # bytes addressed to OTHER ranks
    E = row["shape"]["experts"]
    counts_bytes = E * 8 * (ep - 1) // ep  # the per-expert count exchange (int64)
    minimum = 2 * (m["sent_rows"] + m["received_rows"]) * cfg.hidden_size * 4
    row["bytes"] = {
        "all_to_all_total": _sum(a2a, ep),
        "count_exchange": _sum(counts_bytes, ep),
        "routed_minimum": _sum(minimum, ep),
        "sent_rows": _sum(m["sent_rows"], ep),
        "max_over_mean_expert_load": m["max_over_mean_expert_load"],
    }
    b = row["bytes"]
    b["tokens_over_minimum"] = (
        (b["all_to_all_total"] - b["count_exchange"]) / b["routed_minimum"] if b["routed_minimum"] else None
    )
    # timing, interleaved round by round
    impls = list(IMPLS) if best_impl is None else [best_impl]
    variants = {}
    expert_bytes = sum(p.numel() * 4 for p in hf.experts.parameters())
    for impl in impls:
        if impl == "batched_mm" and (need := batched_mm_bytes(cfg, a.tokens, torch.float32)) > a.batched_mm_gib * 2**30:
            row.setdefault("skipped", {})[f"transformers {impl}"] = (
                f"its forward gathers one copy of the selected expert's weights per token copy, {need / 2**30:.1f} GiB"
            )
            continue
        if impl == "eager" and (need := E * expert_bytes) > a.eager_gib * 2**30:
            row.setdefault("skipped", {})[f"transformers {impl}"] = (
                f"its backward adds a full-size gradient of every expert tensor per expert hit ({E} x "
                f"{expert_bytes / 2**30:.2f} GiB = {need / 2**30:.0f} GiB of memory traffic per step; one step of "
                "the Qwen3 layer at 128 tokens took 335 s here)"
            )
            continue
        variants[f"transformers {impl}"] = (hf, impl)
    variants[f"hfpar ep={ep}"] = (ours, None)
    wall, cpu = {k: [] for k in variants}, {k: [] for k in variants}
    for r in range(a.warmup + a.rounds):
        for name, (block, impl) in variants.items():
            if impl is not None:
                hf_model.set_experts_implementation(impl)
            if ep > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step_block(block, x)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            dt, dc = _max(dt, ep), _max(dc, ep)  # the slowest rank's step
            if r >= a.warmup:
                wall[name].append(dt)
                cpu[name].append(dc)
    row["ms"] = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    row["cpu_ms"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    for key, t in (("", row["cpu_ms"]), ("_wall", row["ms"])):
        hf_t = {k: v for k, v in t.items() if k.startswith("transformers")}
        best = min(hf_t, key=hf_t.get)
        row[f"best_transformers{key}"] = best
        row[f"hfpar_over_best{key}"] = t[f"hfpar ep={ep}"] / hf_t[best]
    return row


def worker(rank: int, ep: int, a, best: dict) -> list[dict]:
    """One rank of ep (run_ranks: a gloo group of ep ranks): its row per shape."""
    torch.set_num_threads(a.threads)
    return [run_shape(shape, a, ep, rank, best.get(shape)) for shape in a.shapes]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4))
    for ax, shape in zip(axes if len(shapes) > 1 else [axes], shapes):
        rs = [r for r in rows if r["name"] == shape]
        eps = [r["ep"] for r in rs]
        best = [r["cpu_ms"][r["best_transformers"]] for r in rs]
        ours = [r["cpu_ms"][f"hfpar ep={r['ep']}"] for r in rs]
        xs = range(len(eps))
        ax.bar([i - 0.2 for i in xs], best, 0.4, label="transformers, best experts impl. (per rank, own tokens)")
        ax.bar([i + 0.2 for i in xs], ours, 0.4, label="hfpar block (expert-parallel over ep ranks)")
        for i, r in zip(xs, rs):
            ratio = r["bytes"]["tokens_over_minimum"]
            ax.text(
                i,
                max(best[i], ours[i]),
                f"{r['hfpar_over_best']:.2f}x\nbytes/min {'-' if ratio is None else f'{ratio:.2f}'}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(xs), [f"ep={e}" for e in eps])
        ax.set_ylabel("forward + backward, CPU ms (slowest rank)")
        ax.set_title(f"{shape}: {rs[0]['tokens_per_rank']} tokens per rank")
        ax.set_ylim(top=max(best + ours) * 1.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(rows: list[dict], a, path: Path) -> None:
    path.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": a.command,
                "torch": torch.__version__,
                "args": {k: v for k, v in vars(a).items() if k != "command"},
                "rows": rows,
            },
            indent=2,
        )
    )
    eps = ", ".join(str(e) for e in dict.fromkeys(r["ep"] for r in rows))
    L = [
        f"# MoE block forward + backward at ep = {eps} (CPU, fp32, gloo)",
        "",
        (
            f"Command: `{a.command}` (torch {torch.__version__}, {a.threads} torch thread(s) per rank). The 2 cores "
            "were "
            "shared with other jobs (load average 15 to 170 during these runs): wall times are inflated many-fold and "
            "noisy, so the primary measure is "
            "the CPU time of the step (process time, the slowest rank's; it includes gloo's threads, not the time "
            "spent "
            "waiting for a peer); wall times, slowest rank, are shown too. Median of "
            f"{a.rounds} interleaved rounds after {a.warmup}."
        ),
        "",
    ]
    for shape in dict.fromkeys(r["name"] for r in rows):
        rs = [r for r in rows if r["name"] == shape]
        s = rs[0]["shape"]
        L += [
            (
                f"## {shape}: H {s['hidden']}, {s['experts']} experts of {s['expert_intermediate']}, top-{s['top_k']}, "
                f"{s['router']}; {rs[0]['tokens_per_rank']} tokens per rank"
            ),
            "",
            (
                "| ep | transformers CPU ms | hfpar CPU ms | hfpar / best (CPU) | wall ms: transformers, hfpar (ratio) "
                "| all-to-all token bytes / routed minimum | all-to-all bytes (+ counts) | output / input-grad rel. "
                "diff |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rs:
            b = r["bytes"]
            hf = ", ".join(f"{k.split()[1]} {v:.0f}" for k, v in r["cpu_ms"].items() if k.startswith("transformers"))
            hfw = ", ".join(f"{k.split()[1]} {v:.0f}" for k, v in r["ms"].items() if k.startswith("transformers"))
            ratio = "- (ep 1: none)" if b["tokens_over_minimum"] is None else f"{b['tokens_over_minimum']:.2f}"
            ours, oursw = r["cpu_ms"][f"hfpar ep={r['ep']}"], r["ms"][f"hfpar ep={r['ep']}"]
            L.append(
                f"| {r['ep']} | {hf} | {ours:.0f} | "
                f"{r['hfpar_over_best']:.2f}x ({r['best_transformers'].split()[1]}) | {hfw}, {oursw:.0f} "
                f"({r['hfpar_over_best_wall']:.2f}x) | {ratio} | "
                f"{b['all_to_all_total'] - b['count_exchange']} (+ {b['count_exchange']}) | "
                f"{r['rel_diff_output']:.1e} / {r['rel_diff_input_grad']:.1e} |"
            )
        skipped = {k: v for r in rs for k, v in r.get("skipped", {}).items()}
        L += [""] + [f"{k} skipped: {v}." for k, v in skipped.items()] + [""]
    path.with_suffix(".md").write_text("\n".join(L) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--shapes", default="qwen3,deepseek_v3")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--qwen3_intermediate", type=int, default=192)
    p.add_argument("--dsv3_intermediate", type=int, default=128)
    p.add_argument("--scale", default="cpu", choices=("cpu", "tiny"), help="tiny: a code-path check")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batched_mm_gib", type=float, default=1.0)
    p.add_argument("--eager_gib", type=float, default=8.0, help="skip eager above this backward traffic per step")
    p.add_argument("--name", default="ep_cpu", help="results file stem under benchmarks/results/moe/")
    a = p.parse_args()
    a.command = command()
    a.shapes = a.shapes.split(",")
    a.overrides = (
        {"qwen3": {}, "deepseek_v3": {}}
        if a.scale == "tiny"
        else {
            "qwen3": {"moe_intermediate_size": a.qwen3_intermediate},
            "deepseek_v3": {"moe_intermediate_size": a.dsv3_intermediate},
        }
    )
    rows, best = [], {}
    path = RESULTS / a.name
    for ep in [int(e) for e in a.eps.split(",")]:
        t0 = time.perf_counter()
        for shape, r in zip(a.shapes, run_ranks(worker, ep, a, best)[0]):
            rows.append({"name": shape, **r})
            best.setdefault(shape, r["best_transformers"].split()[1])
            print(
                f"ep={ep} {shape}: cpu {json.dumps(r['cpu_ms'])} wall {json.dumps(r['ms'])} bytes/min "
                f"{r['bytes']['tokens_over_minimum']} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        write(rows, a, path)  # after every ep: partial results kept
        plot(rows, path.with_suffix(".png"))
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
