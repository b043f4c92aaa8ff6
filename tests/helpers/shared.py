"""Session fixtures built once per test run, also under pytest-xdist (`-n 2`), where each worker is its own session.

    path = built_once(tmp_path_factory, "runs", lambda root: launch(..., root / "single") or str(root / "single"))

The first worker to ask builds under a file lock, in the run's base directory (the workers' common parent); the
others wait for it and reuse the result (JSON: paths as strings). Without xdist it is the plain session fixture.
A build that fails leaves no result, so the next worker to ask tries again (and reports its own failure).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name, numbered=False))
    root = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    result = root.with_name(root.name + ".json")
    with FileLock(str(root) + ".lock"):
        if not result.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            result.write_text(json.dumps(build(root), default=str))
        return json.loads(result.read_text())
