"""The one launcher of the benchmarks (and of the launch tests' commands): where things are, the environment of a
launch, and the three ways a benchmark starts processes.

    from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, module_cmd, results_dir, run_ranks

    subprocess.run(accelerate_cmd("ddp", 2, "sft", ["--max_steps", "8"]), cwd=ROOT, env=env())   # recipes/sft.py
    accelerate_cmd("ddp", 2, "benchmarks.dpo.cp_length", ["--child", spec])   # a module, `accelerate launch -m`
    subprocess.run(module_cmd("benchmarks.memory.loss", "--case", ...), cwd=ROOT)   # a fresh python, one module
    per_rank = run_ranks(fn, 2, *args)       # fn(rank, world_size, *args) on 2 fresh gloo ranks, returns pickled
    results_dir("dpo")                       # benchmarks/results/dpo/ (created)
    command()                                # "python -m benchmarks.dpo.speed --steps 4": what this process runs

Benchmarks run as modules of the repository (`python -m benchmarks.<topic>.<name>` from its root, or anywhere once
installed), so the processes they start run modules too, with the repository root as their working directory.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
_HOST = "127.0.0.1"


def results_dir(topic: str) -> Path:
    """benchmarks/results/<topic>/, created."""
    path = RESULTS / topic
    path.mkdir(parents=True, exist_ok=True)
    return path


def env(*, cpu: bool = True, threads: int | None = 1, **extra: str) -> dict:
    """os.environ for a launch: offline (nothing downloaded), quiet, `threads` OpenMP threads per process (None:
    torch's default); cpu: no GPU visible (CPU + gloo even on a GPU machine)."""
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
        ACCELERATE_DISABLE_RICH="1",
        **extra,
    )
    if threads is not None:
        e["OMP_NUM_THREADS"] = str(threads)
    if cpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def accelerate_cmd(
    config: str,
    nproc: int,
    target: str,
    args: list[str],
    extra_launch: list[str] | None = None,
    *,
    mixed_precision: str | None = "no",
) -> list[str]:
    """`accelerate launch` with accelerate_configs/<config>.yaml of `target`: a recipe's name ("sft": recipes/sft.py),
    a script's path (ending .py) or a dotted module ("benchmarks.dpo.cp_length": launched with -m). mixed_precision
    None: the config's."""
    if target.endswith(".py"):
        script = [target]
    elif "." in target:
        script = ["-m", target]
    else:
        script = [str(ROOT / "recipes" / f"{target}.py")]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / f"{config}.yaml"),
        "--num_processes",
        str(nproc),
        *(["--mixed_precision", mixed_precision] if mixed_precision else []),
        "--main_process_port",
        "0",
        *(extra_launch or []),
        *script,
        *args,
    ]


def command() -> str:
    """This process's command line as a user types it: `python -m benchmarks.<topic>.<name> ARGS` (for the records)."""
    main = Path(sys.argv[0]).resolve()
    if main.is_relative_to(ROOT) and main.suffix == ".py":
        return " ".join(["python", "-m", ".".join(main.relative_to(ROOT).with_suffix("").parts), *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def module_cmd(module: str, *args: str) -> list[str]:
    """A fresh Python process running `module` (run it with cwd=ROOT)."""
    return [sys.executable, "-m", module, *map(str, args)]


def _rank(rank: int, world_size: int, port: int, timeout: float, fn, args, out: str) -> None:
    os.environ.update(
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn, world_size: int, *args, timeout: float = 1800.0) -> list:
    """fn(rank, world_size, *args) on `world_size` fresh processes in one gloo group, one torch thread
    each (fn may set more); their return values, by rank. A failing rank raises here with its traceback. fn must be
    a module-level function (pickled by name); timeout: of each collective, seconds."""
    store = dist.TCPStore(
        _HOST, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )  # the parent hosts the rendezvous: no port race
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":  # one server imports torch once; every rank forks from it (no torch import per rank)
        multiprocessing.get_context(method).set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.start_processes(
            _rank,
            args=(world_size, store.port, timeout, fn, args, out),
            nprocs=world_size,
            join=True,
            start_method=method,
        )
        results = [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world_size)]
    del store
    return results


__all__ = ["ROOT", "RESULTS", "accelerate_cmd", "command", "env", "module_cmd", "results_dir", "run_ranks"]
