"""Measured values the README and docs/ quote, written by the tests that measure (and assert on) them.

    record("loading/minilm_cpu", "ddp", {"eval_accuracy": [0.9, 0.95]}, command="python -m pytest -q
    tests/launch/test_minilm.py")

merges `key: value` into benchmarks/results/<topic>/<name>.json (floats rounded to 3 significant digits, so a
rerun that measures the same thing leaves the file unchanged) next to the command that writes it.
Tests record before they assert: a failing run leaves its numbers for inspection.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform

import torch

from benchmarks.common.launch import RESULTS


def _round(v):
    if isinstance(v, float):
        return float(f"{v:.3g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_round(x) for x in v]
    return v


def record(name: str, key: str, value, *, command: str) -> None:
    """Read, merge and replace under an exclusive lock (the suite runs on several pytest-xdist workers, which may
    record into one file), the new file written aside and renamed over the old one."""
    path = RESULTS / f"{name}.json"  # name: "<topic>/<name>"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(command=command, torch=torch.__version__, machine=platform.machine())
        data.setdefault("values", {})[key] = _round(value)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
