"""DPO under ZeRO-3: the memory per rank of a live reference model beside ZeRO-3 DPO without one.

    python -m benchmarks.dpo.zero3_reference                # -> benchmarks/results/dpo/zero3_reference_cpu.json / .md
    python -m benchmarks.dpo.zero3_reference --steps 4

Three launches of the dpo recipe on its embedded model and pairs, accelerate_configs/zero3.yaml, 2 processes, fp32
(`--mixed_precision no`), one thread each:
  live         the reference a copy of the initial model in a ZeRO-3 engine of its own (ZeRO3Reference)
  precomputed  --precompute_ref_log_probs true: the reference log-probs computed once before training, no model kept
  no_reference --reference_free true: no reference at all (its log-probs are 0)
Per rank, from run_info.json: the policy's parameter bytes (its ZeRO-3 partition), optimizer state, peak memory (on
CPU the process's peak RSS); the reference's parameters per rank in MiB as the line ZeRO3Reference prints them
(rank 0, 2 decimals). live and precomputed train the same model: the JSON records their largest relative per-step
loss difference (live_vs_precomputed_max_rel_loss; 0.0 in the committed run).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir

RUNS = {
    "live": [],
    "precomputed": ["--precompute_ref_log_probs", "true"],
    "no_reference": ["--reference_free", "true"],
}
REF_LINE = re.compile(r"reference model: a ZeRO-3 engine of its own, ([0-9.]+) MiB of parameters per rank")
MIB = 2**20


def launch(name: str, steps: int, out: Path) -> dict:
    """One 2-process ZeRO-3 launch of the dpo recipe -> its bytes per rank, losses and wall time."""
    args = [
        *RUNS[name],
        "--max_steps",
        str(steps),
        "--eval_steps",
        "0",
        "--logging_steps",
        "1",
        "--output_dir",
        str(out),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        accelerate_cmd("zero3", 2, "dpo", args), cwd=ROOT, env=env(), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    info = json.loads((out / "run_info.json").read_text())
    steps_rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ref = REF_LINE.search(proc.stdout + proc.stderr)
    return {
        "flags": RUNS[name],
        "strategy": info["strategy"],
        "world_size": info["world_size"],
        "num_parameters": info["num_parameters"],
        "param_bytes_per_rank": info["param_bytes_per_rank"],
        "reference_param_mib_rank0": float(ref.group(1)) if ref else 0.0,  # as printed: 2 decimals
        "optimizer_state_bytes_per_rank": info["optimizer_state_bytes_per_rank"],
        "peak_mem_bytes_per_rank": info["peak_mem_bytes_per_rank"],
        "host_peak_rss_after_load_bytes_per_rank": info["host_peak_rss_after_load_bytes_per_rank"],
        "losses": [r["loss"] for r in steps_rec if "loss" in r],
        "wall_s": round(wall, 1),
    }


def table(runs: dict) -> str:
    """The markdown table of the runs (MiB per rank)."""

    def mib(values) -> str:
        return " / ".join(f"{v / MIB:.2f}" for v in values)

    rows = [
        "| run | policy params / rank (MiB) | reference params / rank (MiB) | optimizer / rank (MiB) "
        "| peak RSS / rank (MiB) |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        ref = f"{r['reference_param_mib_rank0']:.2f}" if r["reference_param_mib_rank0"] else "-"
        rows.append(
            f"| {name} | {mib(r['param_bytes_per_rank'])} | {ref} | {mib(r['optimizer_state_bytes_per_rank'])} "
            f"| {mib(r['peak_mem_bytes_per_rank'])} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    ap.add_argument("--out", default=None, help="directory of zero3_reference_cpu.json / .md (default results/dpo)")
    a = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            runs[name] = launch(name, a.steps, Path(tmp) / name)
            print(name, json.dumps(runs[name]), flush=True)
    live, pre = runs["live"]["losses"], runs["precomputed"]["losses"]
    result = {
        "command": command(),
        "date": time.strftime("%Y-%m-%dT%H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.system()}, torch {torch.__version__}, CPU (gloo)",
        "config": "accelerate_configs/zero3.yaml, 2 processes, fp32, the dpo recipe's embedded model and pairs",
        "live_vs_precomputed_max_rel_loss": max(
            abs(x - y) / max(abs(y), 1e-12) for x, y in zip(live, pre, strict=True)
        ),
        "runs": runs,
    }
    out = Path(a.out) if a.out else results_dir("dpo")
    (out / "zero3_reference_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    md = f"# DPO under ZeRO-3: memory per rank with and without a live reference\n\n`{result['command']}`\n\n"
    md += f"{result['config']}; {result['machine']}; {result['date']} UTC\n\n{table(runs)}\n"
    (out / "zero3_reference_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
