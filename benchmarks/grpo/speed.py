"""hfpar's grpo recipe against TRL 1.16's GRPOTrainer on the same tiny model, prompts, reward, group size and
completion length, one process, CPU, fp32, one thread each (the machine's 2 cores: one run at a time).

    python -m benchmarks.grpo.speed [--steps 12] [--batch 32]

Two comparisons, each the median step time of steps 3..N:
  full      each trainer generates its own completions (TRL: transformers' generate with its sampling; hfpar: its
            mesh-independent sampler), scores and trains: what a user's step costs;
  training  TRL is handed hfpar's completions (rollout_func), so both train on the same rows: the per-step losses
            are compared and only generation differs in kind.
Writes benchmarks/results/grpo/speed_cpu.json (and prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.grpo import trl_compare as tc

RESULTS = Path(__file__).resolve().parents[1] / "results" / "grpo" / "speed_cpu.json"


def _median_step(records: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in records[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tc.COMMON.update(steps=a.steps, batch=a.batch, completion=16)
    root = Path(tempfile.mkdtemp())
    case = tc.make_case(root, prompts=256)
    kw = {"loss_type": "dapo"}
    t0 = time.perf_counter()
    ours, completions = tc.run_hfpar(*case, str(root / "hfpar"), **kw)
    hfpar_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    trl_same = tc.run_trl(*case, str(root / "trl_same"), completions, **kw)
    trl_same_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    trl_own = tc.run_trl(*case, str(root / "trl_own"), None, **kw)
    trl_own_wall = time.perf_counter() - t0
    h_step = _median_step(ours, "step_time_s")
    gen = statistics.median(r["generation_time_s"] for r in ours[2:] if "generation_time_s" in r)
    tokens = statistics.median(r["tokens_per_s"] for r in ours[2:])
    worst = max(abs(h["loss"] - t["loss"]) for h, t in zip(ours, trl_same)) / max(abs(t["loss"]) for t in trl_same)
    out = {
        "setup": f"tiny Llama (hidden 64, 2 layers), {a.batch} completions a step ({a.batch // 4} prompts x 4), "
        f"up to 16 new tokens, {a.steps} steps, 1 thread, fp32",
        "hfpar_step_s": h_step,
        "hfpar_generation_s": gen,
        "hfpar_tokens_per_s": tokens,
        "trl_step_s (own generation)": _median_step(trl_own, "step_time"),
        "trl_step_s (hfpar's completions)": _median_step(trl_same, "step_time"),
        "speedup_full": _median_step(trl_own, "step_time") / h_step,
        "speedup_training": _median_step(trl_same, "step_time") / (h_step - gen),
        "loss_max_diff_over_max_loss (same completions)": worst,
        "wall_s": {"hfpar": hfpar_wall, "trl_same": trl_same_wall, "trl_own": trl_own_wall},
        "command": "python -m benchmarks.grpo.speed",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
