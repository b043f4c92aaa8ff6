"""Measure every data-parallel strategy on the same work: tokens/s, step time, per-rank bytes, loss.

    python -m benchmarks.strategies.speed                      # tiny default, 2 processes, fp32, 30 steps
    python -m benchmarks.strategies.speed --nproc 4 --steps 50 --mixed_precision bf16
    python -m benchmarks.strategies.speed --model_name_or_path <dir> --max_seq_length 256

Each strategy runs `accelerate launch --config_file accelerate_configs/<s>.yaml recipes/sft.py`
with the same global batch; results go to benchmarks/results/strategies/speed_<device>_<nproc>p.{md,json,png}.
tokens/s is the median over the steps after the first 5 (warm-up). Bytes are what each rank holds
(run_info.json): parameters and optimizer state, next to the theoretical value for the strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir

RESULTS = results_dir("strategies")
STRATEGIES = ["single", "ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_offload"]


def theory(strategy: str, n: int, param_bytes: int, opt_bytes: int) -> tuple[float, float]:
    """Expected (param bytes, optimizer bytes) per rank given the single-process values."""
    shard_params = strategy in ("fsdp2", "zero3", "zero3_offload")
    shard_opt = strategy not in ("single", "ddp")
    return (param_bytes / n if shard_params else param_bytes, opt_bytes / n if shard_opt else opt_bytes)


def run(strategy: str, nproc: int, a, out: Path) -> dict:
    n = 1 if strategy == "single" else nproc
    per_device = a.global_batch // (n * a.accum)
    cmd = accelerate_cmd(
        strategy,
        n,
        "sft",
        [
            "--output_dir",
            str(out),
            "--max_steps",
            str(a.steps),
            "--per_device_train_batch_size",
            str(per_device),
            "--gradient_accumulation_steps",
            str(a.accum),
            "--eval_steps",
            "0",
            "--logging_steps",
            "1000",
            "--max_seq_length",
            str(a.max_seq_length),
            "--model_name_or_path",
            a.model_name_or_path,
        ],
        mixed_precision=a.mixed_precision,
    )
    threads = max(1, (os.cpu_count() or 2) // n)
    proc = subprocess.run(cmd, cwd=ROOT, env=env(cpu=False, threads=threads), capture_output=True, text=True)
    if proc.returncode != 0:
        return {"strategy": strategy, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r][5:]
    info = json.loads((out / "run_info.json").read_text())
    return {
        "strategy": strategy,
        "processes": n,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "step_time_s": statistics.median(r["step_time_s"] for r in steps),
        "final_loss": rows[-1]["loss"] if "loss" in rows[-1] else [r for r in rows if "loss" in r][-1]["loss"],
        "peak_mem_bytes_rank0": max(r["peak_mem_bytes"] for r in steps),
        "param_bytes_per_rank": info["param_bytes_per_rank"],
        "optimizer_state_bytes_per_rank": info["optimizer_state_bytes_per_rank"],
        "num_parameters": info["num_parameters"],
    }


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = [r["strategy"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
    axes[0].set_ylabel("tokens/s (median)")
    axes[0].set_title("throughput")
    w = 0.4
    xs = range(len(ok))
    axes[1].bar([x - w / 2 for x in xs], [r["param_bytes_per_rank"][0] / 1e6 for r in ok], w, label="params")
    axes[1].bar(
        [x + w / 2 for x in xs], [r["optimizer_state_bytes_per_rank"][0] / 1e6 for r in ok], w, label="optimizer state"
    )
    axes[1].set_xticks(list(xs), names)
    axes[1].set_ylabel("MB held by rank 0")
    axes[1].set_title("memory held per rank")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--mixed_precision", default="no")
    p.add_argument("--model_name_or_path", default="hfpar-tiny")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    a = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        from tqdm import tqdm

        for s in tqdm(a.strategies.split(","), desc="strategies"):
            results.append(run(s, a.nproc, a, Path(tmp) / s))
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stem = RESULTS / f"speed_{device}_{a.nproc}p"
    single = next((r for r in results if r["strategy"] == "single" and "error" not in r), None)
    lines = [
        f"# Strategies on {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {device}), {a.nproc} "
        "processes",
        "",
        f"Command: `{command()}`  ",
        f"torch {torch.__version__}; global batch {a.global_batch}, seq <= {a.max_seq_length}, {a.steps} steps, "
        f"mixed precision {a.mixed_precision}; tokens/s = median after 5 warm-up steps.",
        "",
        "| strategy | procs | tokens/s | step s | final loss | param bytes/rank (theory) | optimizer bytes/rank "
        "(theory) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['strategy']} | | failed: {r['error']} | | | | |")
            continue
        tp, to = (
            theory(
                r["strategy"],
                r["processes"],
                single["param_bytes_per_rank"][0],
                single["optimizer_state_bytes_per_rank"][0],
            )
            if single
            else (float("nan"),) * 2
        )
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {r['tokens_per_s']:.0f} | {r['step_time_s']:.3f} | "
            f"{r['final_loss']:.4f} | {r['param_bytes_per_rank'][0]:,} ({tp:,.0f}) | "
            f"{r['optimizer_state_bytes_per_rank'][0]:,} ({to:,.0f}) |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, stem.with_suffix(".png"), f"hfpar strategies, {a.nproc} processes on {device}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
