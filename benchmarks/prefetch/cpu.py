"""The prefetching loader on CPU: a recipe's step wall time with the next steps' batches loaded in a background thread
(--dataloader_prefetch_factor 2, the default) against loading them in the step (0), in one process, runs alternated
(off, on, off, on, ...) so that a change of the machine's load hits both sides alike.

    python -m benchmarks.prefetch.cpu [--recipes sft,dpo --steps 12 --repeats 3 --out benchmarks/results/prefetch]

Each run is the recipe as users run it (hfpar.recipe.main on its embedded default: tiny model, shipped data), one
process, no eval, no export. Its step wall time (metrics.jsonl step_time_s) counts from the moment the loop asks for
the step's batches, so the time spent loading them in the step is in it; the first WARM steps are left out. Both
sides must log the same losses (the rows and their order do not change): checked, and a mismatch stops the
benchmark. Also timed: Trainer._load_step itself (dataset reads, sample hook, collation, host counts, copy), the
host work per step that prefetching takes off the step's path (in the step with prefetch off; in the thread, beside
the step's compute on the same cores, with it on). Writes OUT/cpu.json (every step time) and OUT/cpu.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.dpo.trl_compare import _reset_accelerate
from hfpar import recipe
from hfpar.train.trainer import Trainer

WARM = 2  # first steps left out (allocator, first-touch)
SIDES = {"off": "0", "on": "2"}  # --dataloader_prefetch_factor


LOADS: list[float] = []  # wall seconds of each Trainer._load_step call of the current run
_load_step = Trainer._load_step


def _timed_load(self, step, micro):
    t0 = time.perf_counter()
    out = _load_step(self, step, micro)
    LOADS.append(time.perf_counter() - t0)
    return out


Trainer._load_step = _timed_load


def run(kind: str, steps: int, prefetch: str) -> list[dict]:
    """One run of the recipe; its per-step records."""
    LOADS.clear()
    out = Path(tempfile.mkdtemp(prefix=f"hfpar-prefetch-{kind}-"))
    argv = ["--max_steps", str(steps), "--logging_steps", "1", "--eval_steps", "0", "--save_final_model", "false"]
    argv += ["--output_dir", str(out), "--dataloader_prefetch_factor", prefetch, "--report_to", "none"]
    _reset_accelerate()
    recipe.main(kind, argv)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def measure(kind: str, steps: int, repeats: int) -> dict:
    times = {side: [] for side in SIDES}
    loads = {side: [] for side in SIDES}
    losses = {}
    for _ in range(repeats):
        for side, factor in SIDES.items():
            recs = run(kind, steps, factor)
            times[side] += [r["step_time_s"] for r in recs[WARM:]]
            loads[side] += LOADS[WARM:]
            seen = [r["loss"] for r in recs]
            if losses.setdefault(side, seen) != seen:
                raise SystemExit(f"{kind} prefetch {side}: the losses changed between repeats")
    if losses["off"] != losses["on"]:
        raise SystemExit(f"{kind}: prefetching changed the losses: {losses['off']} vs {losses['on']}")
    med = {side: statistics.median(v) for side, v in times.items()}
    return {
        "step_wall_s_median": med,
        "step_wall_s_mean": {side: statistics.fmean(v) for side, v in times.items()},
        "speedup_median": med["off"] / med["on"],
        "load_step_s_median": {side: statistics.median(v) for side, v in loads.items()},
        "steps_timed_per_side": len(times["on"]),
        "losses_identical": True,
        "step_times_s": times,
    }


def table(results: dict, meta: dict) -> str:
    lines = [
        "# The prefetching loader on CPU: step wall time",
        "",
        f"`{meta['command']}` ({meta['when']}, torch {meta['torch']}, {meta['threads']} torch threads, load "
        f"average at the end {meta['load_average_1_5_15_min_at_end']})",
        "",
        "| recipe | step wall, prefetch off (median) | prefetch on (median) | off / on | loading a step's batches "
        "(median; off / on) | steps timed per side | losses |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, r in results.items():
        m, ld = r["step_wall_s_median"], r["load_step_s_median"]
        lines.append(
            f"| {kind} | {m['off'] * 1e3:.1f} ms | {m['on'] * 1e3:.1f} ms | {r['speedup_median']:.3f}x | "
            f"{ld['off'] * 1e3:.1f} / {ld['on'] * 1e3:.1f} ms | {r['steps_timed_per_side']} | identical |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="sft,dpo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/prefetch")
    a = p.parse_args()
    results = {kind: measure(kind, a.steps, a.repeats) for kind in a.recipes.split(",")}
    meta = {
        "command": f"python -m benchmarks.prefetch.cpu --recipes {a.recipes} --steps {a.steps} --repeats {a.repeats}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1_5_15_min_at_end": list(os.getloadavg()),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (out / "cpu.md").write_text(table(results, meta))
    print(table(results, meta))


if __name__ == "__main__":
    main()
