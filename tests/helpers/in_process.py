"""A recipe run as one process, in the test's own process (the one-process references of the parity tests).

run_in_process("dpo", argv)                     # main("dpo", argv), one thread, Accelerate's state reset around it
run_in_process("grpo", argv, {"ACCELERATE_MIXED_PRECISION": "bf16"})
"""

from __future__ import annotations

import os

import torch


def run_in_process(kind: str, argv: list[str], env: dict | None = None) -> None:
    """One thread (a launch's OMP_NUM_THREADS=1; two threads on a loaded 2-core machine spin 10x slower), `env` set
    for the run only, Accelerate's singletons reset around it."""
    # the training stack: imported by the slow tests that run it, not at collection
    from benchmarks.dpo.trl_compare import _reset_accelerate
    from hfpar.recipe import main

    threads, saved = torch.get_num_threads(), {k: os.environ.get(k) for k in env or {}}
    torch.set_num_threads(1)
    os.environ.update(env or {})
    _reset_accelerate()
    try:
        main(kind, argv)
    finally:
        _reset_accelerate()
        torch.set_num_threads(threads)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
