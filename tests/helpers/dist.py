"""Spawn N gloo ranks (CPU) from a test and turn any rank's exception into a pytest failure.

    from tests.helpers.dist import run_distributed

    def _check(rank, world_size, scale):        # module level, so spawn can pickle it
        t = torch.ones(2) * scale * (rank + 1)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((2,), scale * 3.0))
        return t.sum().item()                    # optional: returned to the caller per rank

    def test_all_reduce():
        assert run_distributed(_check, 2, 1.0) == [6.0, 6.0]

`fn(rank, world_size, *args)` runs in a fresh process inside an initialised default gloo group
(env:// variables MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set; the caller's os.environ is
copied in); the call returns the list of per-rank return values (they must pickle). Start ranks
once per world size and run many checks inside `fn`. Ranks are forked from a forkserver that has
torch and transformers imported already (milliseconds per rank instead of seconds of imports); note that
env vars they read at import time are those of the first call's environment.

No port race: the parent process hosts the rendezvous TCPStore on a port the OS picks (port 0),
and the ranks connect to it as clients. When a rank fails, the other ranks are usually blocked in
a collective; they are terminated at once and the failing rank's traceback is raised here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]

_HOST = "127.0.0.1"


def _worker(rank: int, world_size: int, port: int, fn, args, results, environ: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        out = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        # Report before tearing the group down: closing it makes the peers fail with
        # "Connection closed by peer", which must not mask this root cause.
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, True, out))


def _secondary(msg: str) -> bool:
    """A failure caused by another rank going away (not the root cause)."""
    return any(
        s in msg
        for s in ("Connection closed by peer", "remote worker", "Connection reset by peer", "died without reporting")
    )


def _context(start_method: str | None):
    """forkserver (Linux): one server process imports torch and transformers once, then every rank of every call
    forks from it, so starting ranks costs milliseconds instead of a torch import each (seconds
    on a busy 2-core box). The server is single-threaded, so forking it is safe. Else spawn."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # transformers' modeling code too: nearly every rank builds an HF model (~5 CPU-s of imports each otherwise)
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", __name__]
        )
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, start_method: str | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh gloo ranks; return per-rank results.

    start_method: None = "forkserver" where available, else "spawn" (either way a fresh process
    that re-imports the test module; `fn` and `args` must pickle).

    Raises AssertionError carrying the failing ranks' tracebacks, root cause first (or a timeout /
    crash report).
    """
    ctx = _context(start_method)
    # The parent hosts the store: the OS picks a free port and keeps it bound, so no race.
    store = dist.TCPStore(
        _HOST, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store.port, fn, args, results, dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    grace = None  # after a first failure, wait briefly for the others (the root cause may be among them)
    try:
        while len(out) + len(failures) < world_size:
            now = time.monotonic()
            if grace is not None and now > grace:
                break
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if now > deadline:
                    failures.append(f"timed out after {timeout:.0f}s; ranks done: {sorted(out)}")
                    break
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and grace is None:
                    failures.append(f"rank(s) died without reporting (rank, exitcode): {dead}")
                    grace = time.monotonic() + 2.0
                continue
            if ok:
                out[rank] = value
            else:
                failures.append(f"rank {rank} of {world_size} failed:\n{value}")
                grace = grace or time.monotonic() + 2.0
    finally:
        for p in procs:
            if failures and p.is_alive():
                p.terminate()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    failure = None
    if failures:
        failures.sort(key=_secondary)  # root causes first (stable)
        failure = "\n".join(failures)
    if failure is not None:
        raise AssertionError(f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}): {failure}")
    return [out[r] for r in range(world_size)]


def value_error_message(fn) -> str:
    """Call fn(); the ValueError message it raised, or "no error" (lets ranks return refusals as data)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"
