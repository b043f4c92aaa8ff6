"""Run a recipe the way users do (`accelerate launch --config_file ...`) and read its outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
             TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", ACCELERATE_DISABLE_RICH="1")
    # The suite's launches compare CPU + gloo runs with each other (the parity contract): on a machine with a GPU
    # they are kept on the CPU too, since a 2-process launch on a one-GPU machine is refused (one CUDA device per
    # process) and a GPU reference would add device-numerics noise. HFPAR_TEST_CUDA=1 launches on the GPUs instead.
    if os.environ.get("HFPAR_TEST_CUDA") != "1":
        e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def launch_cmd(config: str, nproc: int, recipe: str, args: list[str], extra_launch: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--num_processes", str(nproc), "--mixed_precision", "no", "--main_process_port", "0",
            *(extra_launch or []), str(ROOT / "recipes" / f"{recipe}.py"), *args]


def launch(config: str, nproc: int, recipe: str, args: list[str], *, check: bool = True, timeout: int = 600,
           extra_launch: list[str] | None = None, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = launch_cmd(config, nproc, recipe, args, extra_launch)
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def launch_all(jobs: dict, workers: int = 2) -> None:
    """{name: (config, nproc, recipe, args)} launched `workers` at a time (a launch is mostly process
    start-up and rendezvous, which overlap well on 2 cores); raises the first failure."""
    with ThreadPoolExecutor(workers) as pool:
        done = [pool.submit(launch, *job) for job in jobs.values()]
        for f in done:
            f.result()


def read_metrics(out: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from metrics.jsonl."""
    rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def read_run_info(out: str | Path) -> dict:
    return json.loads(Path(out, "run_info.json").read_text())


def model_with_unreadable_weights(src: str | Path, dst: str | Path) -> str:
    """A copy of a saved model (config, tokenizer) whose weights file is not safetensors: any run that reads a
    weight fails on it, so a clean one-line refusal proves the refusal came before the weights were read."""
    shutil.copytree(src, dst)
    Path(dst, "model.safetensors").write_bytes(b"these are not weights")
    return str(dst)


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the reference b (the parity files' per-step measure)."""
    return abs(a - b) / max(abs(b), 1e-12)


def rel_close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)
