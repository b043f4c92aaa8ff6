"""Loss curves of the embedded sft recipe under DDP, FSDP2 and ZeRO-3: docs/strategies_loss.png (shown in
docs/recipes.md).

    python -m benchmarks.strategies.loss_curves      # writes docs/strategies_loss.png and
                                              # benchmarks/results/strategies/loss_curves_cpu_2p.{md,json}

Each strategy runs `accelerate launch --config_file accelerate_configs/<s>.yaml --num_processes 2
--mixed_precision no recipes/sft.py --max_steps 60 --eval_steps 20` (the recipe's defaults otherwise);
the plot is `hfpar plot` of the three run directories (named after the strategy); the json / md record
the eval loss at every evaluation and the final train loss of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import launch
from benchmarks.common.launch import ROOT, accelerate_cmd, results_dir

RESULTS = results_dir("strategies")
RECIPE_ARGS = ["--max_steps", "60", "--eval_steps", "20"]


def run(strategy: str, nproc: int, out: Path) -> None:
    cmd = accelerate_cmd(strategy, nproc, "sft", [*RECIPE_ARGS, "--output_dir", str(out)])
    env = launch.env(cpu=False, threads=max(1, (os.cpu_count() or 2) // nproc))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{proc.stderr[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="ddp,fsdp2,zero3")
    p.add_argument("--plot", default=str(ROOT / "docs" / "strategies_loss.png"))
    a = p.parse_args()
    import torch

    from hfpar.observe.plot import plot_runs, read_run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stem = RESULTS / f"loss_curves_{device}_{a.nproc}p"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for s in a.strategies.split(","):
            out = Path(tmp) / s
            run(s, a.nproc, out)
            train, evals, info = read_run(out)
            results[s] = {
                "strategy_in_effect": info.get("strategy"),
                "eval_loss_by_step": {str(e["step"]): e["eval_loss"] for e in evals},
                "final_train_loss": train[-1]["loss"],
            }
            dirs.append(out)
        plot_runs(dirs, a.plot)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = launch.command()
    stem.with_suffix(".json").write_text(
        json.dumps(
            {"command": command, "torch": torch.__version__, "recipe_args": RECIPE_ARGS, "runs": results}, indent=2
        )
        + "\n"
    )
    steps = sorted({int(k) for r in results.values() for k in r["eval_loss_by_step"]})
    lines = [
        f"# sft recipe loss under {', '.join(results)} ({a.nproc} processes, {device}, fp32)",
        "",
        f"Command: `{command}` (torch {torch.__version__}); each run: `recipes/sft.py {' '.join(RECIPE_ARGS)}`; "
        f"plot: {Path(a.plot).resolve().relative_to(ROOT) if Path(a.plot).resolve().is_relative_to(ROOT) else a.plot}",
        "",
        "| strategy | " + " | ".join(f"eval loss @ {s}" for s in steps) + " | final train loss |",
        "|---|" + "---|" * (len(steps) + 1),
    ]
    for s, r in results.items():
        ev = r["eval_loss_by_step"]
        lines.append(
            f"| {s} | "
            + " | ".join(f"{ev[str(k)]:.4f}" if str(k) in ev else "" for k in steps)
            + f" | {r['final_train_loss']:.4f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
