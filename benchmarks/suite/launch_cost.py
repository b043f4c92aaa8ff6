"""Fixed cost of one test launch: a 2-process DDP run of 8 steps of the embedded sft recipe (CPU + gloo), launched
with exactly the command and environment the launch tests use (tests/helpers/launch.py's launch_cmd and env),
measured as wall seconds and CPU seconds of the whole process tree (launcher + ranks: resource.getrusage
RUSAGE_CHILDREN, which sums every waited-for descendant), median of --repeats runs.

    python -m benchmarks.suite.launch_cost                          # this tree -> results/suite/launch_cost.json
    python -m benchmarks.suite.launch_cost --baseline /tmp/before   # also another commit's checkout, interleaved

With --baseline the two trees' launches alternate (baseline, this tree, baseline, ...), so both see the same load on
a shared machine; each tree is launched with its own launch_cmd / env (asked in a subprocess in that tree).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from benchmarks.common.launch import ROOT, results_dir

OUT = results_dir("suite") / "launch_cost.json"
# the parity tests' 8-step schedule (tests/helpers/parity.py COMMON) on the embedded default model and data
ARGS = [
    "--max_steps",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "2e-3",
    "--warmup_steps",
    "2",
    "--max_grad_norm",
    "1.0",
    "--logging_steps",
    "1",
    "--save_steps",
    "4",
    "--per_device_eval_batch_size",
    "8",
    "--max_eval_samples",
    "48",
    "--weight_decay",
    "0.01",
    "--per_device_train_batch_size",
    "2",
]
# printed by a subprocess in the measured tree (its working directory: `python -c` imports from there), that tree's
# test launcher's command and environment for the run above (what is measured is the tests' launch, in any commit)
_ASK = """import json, sys
from tests.helpers.launch import env, launch_cmd
print(json.dumps({"cmd": launch_cmd("ddp", 2, "sft", json.loads(sys.argv[1])), "env": env()}))"""


def command_of(tree: Path, out_dir: str) -> tuple[list[str], dict]:
    asked = subprocess.run(
        [sys.executable, "-c", _ASK, json.dumps([*ARGS, "--output_dir", out_dir])],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    spec = json.loads(asked.stdout)
    # the tree's own hfpar, whatever the editable install points at
    spec["env"]["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return spec["cmd"], spec["env"]


def measure(tree: Path) -> dict:
    """One launch in `tree`: wall seconds and CPU seconds (user + system) of its whole process tree."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd, env = command_of(tree, str(Path(tmp) / "out"))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"launch failed in {tree}:\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cmd": cmd}


def summary(runs: list[dict], tree: Path) -> dict:
    return {
        "median_wall_s": round(statistics.median(r["wall_s"] for r in runs), 2),
        "median_cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
        "wall_s": [r["wall_s"] for r in runs],
        "cpu_s": [r["cpu_s"] for r in runs],
        "command": " ".join(Path(c).name if c == sys.executable else c for c in runs[0]["cmd"]).replace(
            str(tree), "<tree>"
        ),
    }


def git_commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another checkout (e.g. git clone + checkout of the old commit)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    trees = {"this": ROOT} | ({"baseline": a.baseline.resolve()} if a.baseline else {})
    runs = {name: [] for name in trees}
    for i in range(a.repeats):
        for name in reversed(trees):  # baseline first in each round
            runs[name].append(measure(trees[name]))
            print(
                f"round {i + 1} {name}: wall {runs[name][-1]['wall_s']} s, cpu {runs[name][-1]['cpu_s']} s", flush=True
            )
    result = {
        "what": "2-process DDP launch (CPU + gloo) of 8 steps of the embedded sft recipe, "
        "wall and CPU seconds of the whole process tree, median of the repeats",
        "torch": metadata.version("torch"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": a.repeats,
        **{name: {"commit": git_commit(tree), **summary(runs[name], tree)} for name, tree in trees.items()},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in trees}, indent=2))


if __name__ == "__main__":
    main()
