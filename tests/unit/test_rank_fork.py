"""The suite's rank processes forked from pre-imported zygotes (tests/helpers/rank_zygote.py, rank_trampoline.py):
whatever runs through the trampoline ends as a fresh interpreter would (exit code, signal, output, argv, sys.path,
cwd, environment), signals reach the rank, a rank dies with its trampoline, ranks hash differently, and an
environment the zygote's imports could have read differently runs a fresh interpreter instead. The zygotes import
only `json` here (HFPAR_TEST_RANK_IMPORTS): the mechanism, in seconds; the recipe launches of the suite run through
it with the whole stack (tests/launch/test_rank_fork_launch.py checks their result is the fresh one's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import RANK_ZYGOTES, rank_decisions
from tests.helpers.rank_zygote import refusal
from tests.helpers.zygote import _Ranks

SCRIPT = """import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "path": sys.path, "cwd": os.getcwd(),
                  "x": os.environ.get("HFPAR_X"), "hash": hash("hfpar"), "pid": os.getpid(), "ppid": os.getppid(),
                  "main": __name__,
                  "zygotes": "HFPAR_TEST_RANK_ZYGOTES" in os.environ}))
print("to stderr", file=sys.stderr)
mode = os.environ.get("HFPAR_MODE", "")
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":
    import signal, time
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(3)))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
sys.exit(int(os.environ.get("HFPAR_CODE", "0")))
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HFPAR_TEST_RANK_IMPORTS", "json")
        r = _Ranks(str(folder), RANK_ZYGOTES)
    rank_decisions(folder, timeout=60)  # all of them accept requests
    yield r
    r.close()


def _trampoline(ranks, tmp_path, args, env=None, local_rank="0") -> tuple[list, dict]:
    """The command and environment of SCRIPT started through the trampoline, as a launcher of `ranks` starts it."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    full = {**os.environ, "HFPAR_TEST_RANK_IMPORTS": "json", "LOCAL_RANK": local_rank, **(env or {})}
    full["HFPAR_TEST_RANK_ZYGOTES"] = f"{ranks.dir}:{RANK_ZYGOTES}"
    return [ranks.python, "-u", str(script), *args], full


def _run(ranks, tmp_path, *args, env=None, local_rank="0"):
    cmd, full = _trampoline(ranks, tmp_path, args, env, local_rank)
    return subprocess.run(cmd, env=full, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def _decisions(ranks) -> str:
    return rank_decisions(ranks.dir)


def test_a_rank_runs_as_a_fresh_interpreter_would(ranks, tmp_path):
    forked = _run(ranks, tmp_path, "a", "--b", env={"HFPAR_X": "1", "HFPAR_CODE": "7"})
    fresh = subprocess.run(
        [sys.executable, "-u", str(tmp_path / "script.py"), "a", "--b"],
        env={**os.environ, "HFPAR_X": "1", "HFPAR_CODE": "7"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert forked.returncode == fresh.returncode == 7
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert f"fork {got['pid']}" in _decisions(ranks)  # forked, not run fresh
    for key in ("argv", "path0", "cwd", "x", "main", "zygotes", "ppid"):
        assert got[key] == want[key], key
    assert got["ppid"] == os.getpid()  # the process that started it, as torchrun's agent is a worker's parent
    assert got["zygotes"] is False  # the trampoline's variable is not part of the rank's environment
    assert forked.stderr == fresh.stderr == "to stderr\n"


def test_an_exception_ends_the_rank_with_its_traceback_and_status_1(ranks, tmp_path):
    proc = _run(ranks, tmp_path, env={"HFPAR_MODE": "raise"})
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("ValueError: boom"), proc.stderr


def test_signals_reach_the_rank_and_a_rank_dies_with_its_trampoline(ranks, tmp_path):
    pidfile = tmp_path / "pid"
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pidfile.unlink(missing_ok=True)
        cmd, env = _trampoline(ranks, tmp_path, ["x", str(pidfile)], {"HFPAR_MODE": "sleep"}, local_rank="1")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rank = int(pidfile.read_text())
        assert rank != proc.pid
        proc.send_signal(sig)
        proc.wait(timeout=30)
        if sig == signal.SIGTERM:  # forwarded: the rank's handler ran and its exit code is the trampoline's
            assert proc.returncode == 3 and b"got SIGTERM" in proc.stdout.read()
        else:  # SIGKILL cannot be forwarded: the rank gets SIGIO from the pipe the dead trampoline held
            assert proc.returncode == -signal.SIGKILL
        while time.monotonic() < deadline:
            if not Path(f"/proc/{rank}").exists() or "Z" in Path(f"/proc/{rank}/stat").read_text().split()[2]:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank {rank} outlived its trampoline after {sig!r}")


def test_ranks_hash_strings_differently_as_fresh_interpreters_do(ranks, tmp_path):
    hashes = {json.loads(_run(ranks, tmp_path, local_rank=str(k)).stdout)["hash"] for k in range(RANK_ZYGOTES)}
    assert len(hashes) == RANK_ZYGOTES


def test_an_environment_the_imports_could_have_read_differently_runs_fresh(ranks, tmp_path):
    proc = _run(ranks, tmp_path, env={"OMP_NUM_THREADS": "3"})  # read by libraries at load: not a launch variable
    assert proc.returncode == 0
    assert f"fork {json.loads(proc.stdout)['pid']}" not in _decisions(ranks)
    assert "fresh OMP_NUM_THREADS differs from the zygote's environment" in _decisions(ranks)
    # a launch's own variables (rank, ports, Accelerate's) may differ: still forked
    proc = _run(ranks, tmp_path, env={"MASTER_PORT": "1234", "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert f"fork {json.loads(proc.stdout)['pid']}" in _decisions(ranks)


def test_a_pythonpath_that_shadows_no_import_forks_with_its_entries_where_the_interpreter_puts_them(ranks, tmp_path):
    """The suite's own-code and example launches put the repository root on PYTHONPATH: forked, sys.path as fresh."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "mine.py").write_text("X = 1\n")
    forked = _run(ranks, tmp_path, env={"PYTHONPATH": str(extra)})
    fresh = subprocess.run(
        [sys.executable, "-u", str(tmp_path / "script.py")],
        env={**os.environ, "PYTHONPATH": str(extra)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert f"fork {got['pid']}" in _decisions(ranks)
    assert got["path"] == want["path"] and str(extra) in got["path"]
    # an entry that holds a name the zygote imported (its runpy) or a start-up hook could change an import: fresh
    for name in ("runpy.py", "sitecustomize.py"):
        folder = tmp_path / name.partition(".")[0]
        folder.mkdir()
        (folder / name).write_text("")
        proc = _run(ranks, tmp_path, env={"PYTHONPATH": str(folder)})
        assert f"fresh PYTHONPATH entry {folder} holds {name}" in _decisions(ranks), proc.stderr
    assert refusal({"PYTHONPATH": "rel"}, {}, set()) == "PYTHONPATH entry 'rel' is relative"


def test_cuda_device_variables_read_at_import_fork_only_where_no_cuda_driver_exists():
    """Under PyPI's CUDA build torch counts the visible devices while imported: without a driver it counts none,
    whatever Accelerate sets for a `single` rank (CUDA_VISIBLE_DEVICES=0) or DeepSpeed's (PYTORCH_NVML_BASED_...)."""
    read = {"CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK"}
    for key, value in (("CUDA_VISIBLE_DEVICES", "0"), ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")):
        assert refusal({key: value}, {}, read, no_cuda_device=True) is None
        assert refusal({key: value}, {key: ""}, read, no_cuda_device=True) is None
        assert refusal({key: value}, {}, read, no_cuda_device=False) is not None  # a machine with a driver
    assert refusal({"CUDA_VISIBLE_DEVICES": "0"}, {}, set()) is None  # not read at import (the +cpu wheel)
