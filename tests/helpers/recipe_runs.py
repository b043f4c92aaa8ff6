"""Several runs of a recipe in one launch: `hfpar.recipe.main(kind, argv)` once per argv, in order, so that the
workers' start-up (Python, torch, transformers, accelerate and hfpar imports: most of a tiny launch's CPU time) is
paid once for all of them.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 tests/helpers/recipe_runs.py RUNS
    (tests: launch("ddp", 2, RECIPE_RUNS, [RUNS]) with tests/helpers/launch.py)

RUNS: a JSON file {"kind": "sft", "runs": [argv, ...]}; every process runs every argv. A run may also be
{"argv": [...], "env": {...}}: variables set for that run only (ACCELERATE_MIXED_PRECISION: what `accelerate launch
--mixed_precision` sets for a whole launch), and {"copy": [src, dst]}: a directory copied by the first process before
the run (the others wait at a barrier): a run resuming from a checkpoint that an earlier run of the same launch
wrote. Between runs Accelerate's state singletons are reset, as a fresh
process has them. The process group is kept from one run to the next: the
recipe destroys it at its end, and a second init_process_group on the launcher's rendezvous store would meet the
first group's keys there; it is destroyed after the last run. Each run is otherwise the recipe as users run it
(same entry point, same argv parsing, same preflight, parallelization, backend and trainer).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState, PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hfpar import recipe


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _reset_deepspeed() -> None:
    """DeepSpeed keeps its parallel groups in module globals (deepspeed.utils.groups: the mpu, the model-parallel
    world size...) and transformers its ZeRO-3 config in one: a fresh process starts with neither, so the next run
    must too (a TP run's mpu would otherwise make the next run's engine ask a None mpu for its rank)."""
    if "deepspeed.utils.groups" in sys.modules:
        importlib.reload(sys.modules["deepspeed.utils.groups"])
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()


def _copy(src: str, dst: str) -> None:
    """src copied into dst by the first process, the others waiting (the runs' output dirs are shared by the ranks
    of a test launch: one machine)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    if dist.is_initialized():
        dist.barrier()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the recipe's own call at its end: kept for the next run
    try:
        for run in spec["runs"]:
            argv, env = (run["argv"], run.get("env", {})) if isinstance(run, dict) else (run, {})
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            _reset_accelerate()
            _reset_deepspeed()
            if isinstance(run, dict) and "copy" in run:
                _copy(*run["copy"])
            try:
                recipe.main(spec["kind"], argv)
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()


if __name__ == "__main__":
    main(sys.argv[1])
