"""A pre-imported Python the suite's rank processes fork from (the launcher's counterpart: tests/helpers/zygote.py).

    python tests/helpers/rank_zygote.py SOCKET      # started by zygote.py, one per local rank, each its own hash seed

Every rank of a test launch used to be a fresh interpreter importing torch, transformers, accelerate and datasets:
~5-9 CPU-s each (benchmarks/suite/launch_cost.py), about half the suite's CPU on 2 cores. This process imports them
once; torchrun's worker command reaches it through tests/helpers/rank_trampoline.py (the launcher's python, there),
and it forks the rank: the same argv, environment, working directory and stdin / stdout / stderr (passed as file
descriptors), `python -u script.py ARGS` or `python -u -m module ARGS` run as `__main__`. The rank exits through
the interpreter's own exit (atexit, stdio flush, finalization) and its wait status goes back to the trampoline,
which ends with it; signals sent to the trampoline are forwarded.

A fork is exact only where the imports done here would have gone the same way in the rank: so a request is refused
(the trampoline then runs a fresh interpreter, as without this file) when its environment differs from this
process's in any variable other than the launch's own run-time ones (`LAUNCH_VARIABLES`), or in one of those that
an import here read (recorded while importing); two exceptions, each exact: a PYTHONPATH whose added entries hold
no name imported here (nor a start-up hook), and the variables that pick CUDA devices on a machine without a CUDA
driver (`refusal`). Each local rank has its own zygote started with its own
PYTHONHASHSEED, so ranks still hash strings differently, as fresh interpreters do (a rank-dependent set order stays
visible to the tests). Nothing here runs a torch op or starts a thread before the fork.
"""

from __future__ import annotations

import ctypes
import faulthandler
import fcntl
import functools
import io
import json
import os
import random
import re
import runpy
import select
import signal
import socket
import sys
import time

LAUNCH_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE"
    r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING|NCCL_ASYNC_ERROR_HANDLING"
    r"|ACCELERATE_\w+|FSDP_\w+|CUDA_VISIBLE_DEVICES"  # the launcher's (Accelerate's sets the device of 'single')
    r"|HFPAR_\w+|PYTEST_\w+)"  # hfpar's (imported fresh in the rank), pytest's current test
)
CUDA_DISCOVERY = ("CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK")  # what decides which CUDA devices torch sees
# what every rank of a recipe imports anyway (third-party only: hfpar's own code is imported fresh);
# HFPAR_TEST_RANK_IMPORTS=a,b replaces the list (tests/unit/test_rank_fork.py: the mechanism without the stack)
PREIMPORTED = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "accelerate",
    "transformers",
    "transformers.modeling_utils",
    "datasets",
    "safetensors.torch",
    "matplotlib.figure",  # the run's report.png, drawn by Agg (hfpar/observe/plot.py): ~1 CPU-s a run
    "matplotlib.backends.backend_agg",
)


class _RecordingEnviron(os._Environ):
    """os.environ that remembers which variables were read (while the stack is imported). Values fetched for the
    keys a walk of the environment yielded are not counted until the next walk: copying it (fsspec's
    `dict(os.environ)`) or filtering it by prefix (tqdm's TQDM_*) reads no one variable."""

    read: set = set()
    walked: set = set()

    def __iter__(self):
        self.walked.clear()
        for key in super().__iter__():
            self.walked.add(key)
            yield key

    def __getitem__(self, key):
        if key in self.walked:
            self.walked.discard(key)
        else:
            self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _import_stack() -> tuple[dict, set]:
    os.environ.pop("PYTHONHASHSEED", None)  # set for this process's hashes only: a rank's env does not have it
    base = dict(os.environ)
    env = os.environ
    os.environ = _RecordingEnviron(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
    try:
        names = os.environ.get("HFPAR_TEST_RANK_IMPORTS")
        for name in names.split(",") if names else PREIMPORTED:
            __import__(name)
    finally:
        os.environ = env
    return base, set(_RecordingEnviron.read)


def refusal(env: dict, base: dict, read_at_import: set, no_cuda_device: bool = False) -> str | None:
    """Why `env` cannot be a fork of this process (None: it can). no_cuda_device: this machine has no CUDA driver
    (`_no_cuda_device`)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context does not survive fork
        return "CUDA is initialised in the zygote"
    for key in sorted(set(env) | set(base)):
        if env.get(key) == base.get(key):
            continue
        if key == "PYTHONPATH":
            why = _path_refusal(env.get(key, ""), base.get(key, ""))
            if why is not None:
                return why
            continue
        if key in CUDA_DISCOVERY and no_cuda_device:
            # torch's import counts the CUDA devices through these (dynamo registers one device interface each):
            # without a driver it counts none whatever they say. A CPU machine under PyPI's CUDA build (CI's):
            # Accelerate sets CUDA_VISIBLE_DEVICES=0 for the `single` config's rank, PYTORCH_NVML_BASED_CUDA_CHECK
            # for DeepSpeed's ranks
            continue
        if not LAUNCH_VARIABLES.fullmatch(key):
            return f"{key} differs from the zygote's environment"
        if key in read_at_import:
            return f"{key} was read while importing the stack"
    return None


def _no_cuda_device() -> bool:
    """No CUDA device can exist here: torch built without CUDA, or no driver library to load (dlopen only: no CUDA
    call, nothing a fork would inherit)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def _entries(pythonpath: str) -> list:
    return [p for p in pythonpath.split(os.pathsep) if p]


def _path_refusal(pythonpath: str, base: str) -> str | None:
    """Why a rank with this PYTHONPATH would not import what the zygote did (None: it would). Its entries come
    before site-packages, so an entry that holds a top-level name the zygote imported (or a sitecustomize /
    usercustomize, run at start-up) could have changed an import; one that does not leaves every import here as
    it was, and become() puts the entries where the interpreter puts them. The suite's own-code and example
    launches add the repository root (hfpar, recipes, tests, ...: none imported here)."""
    old, new = _entries(base), _entries(pythonpath)
    if any(p not in new for p in old):
        return "PYTHONPATH drops an entry of the zygote's"
    imported = {name.partition(".")[0] for name in sys.modules} | {"sitecustomize", "usercustomize"}
    for entry in new:
        if entry in old:
            continue
        if not os.path.isabs(entry):
            return f"PYTHONPATH entry {entry!r} is relative"
        if os.path.isfile(entry):
            return f"PYTHONPATH entry {entry} is a file (an archive)"
        for child in os.listdir(entry) if os.path.isdir(entry) else ():
            if child.partition(".")[0] in imported:
                return f"PYTHONPATH entry {entry} holds {child}"
    return None


def _reap(ranks: dict, log) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            except OSError:  # the trampoline is gone (its rank was told by SIGIO)
                pass
            conn.close()
            log(f"exit {pid} {status}")


def serve(path: str) -> dict | None:
    """Serve fork requests until stdin closes (the launch zygote ended); returns only in a forked rank: its
    request (rank_trampoline.py's: argv, module, unbuffered, env, cwd, ppid) and the descriptors it passed."""
    base, read_at_import = _import_stack()
    no_cuda_device = _no_cuda_device()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.replace(path + ".tmp", path)  # the trampolines connect only once the stack is imported
    log_file = open(path + ".log", "a", buffering=1)  # noqa: SIM115 -- the decisions, read by the tests
    ranks: dict = {}  # pid -> the trampoline's connection

    def log(line: str) -> None:
        log_file.write(f"{time.time():.3f} {line}\n")

    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin, listener], [], [], 0.05)
        _reap(ranks, log)
        if stdin in ready and not os.read(stdin, 1 << 16):
            break
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
        req = json.loads(msg)
        why = refusal(req["env"], base, read_at_import, no_cuda_device)
        if why is not None:
            conn.sendall(json.dumps({"fresh": why}).encode() + b"\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            log(f"fresh {why}")
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in ranks.values():
                other.close()
            conn.close()
            log_file.close()
            return {**req, "fds": fds, "base_pythonpath": base.get("PYTHONPATH", "")}
        for fd in fds:
            os.close(fd)
        ranks[pid] = conn
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        log(f"fork {pid} {req['argv'][:1]}")
    listener.close()
    os.unlink(path)
    return None


def _stdio(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """As the interpreter opens stdout (fd 1) / stderr (fd 2): -u write-through over an unbuffered file, else
    buffered, line-buffered on a terminal and always for stderr (Python >= 3.9); stderr's errors backslashreplace."""
    binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(
        binary,
        encoding="utf-8",
        errors="backslashreplace" if fd == 2 else "strict",
        line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
        write_through=unbuffered,
    )


def become(req: dict) -> None:
    """In the forked rank: take the request's session, stdio, pipe watch, cwd, env, argv and sys.path, then run
    its script or module as __main__ (what `python [-u] script.py ARGS` / `python [-u] -m module ARGS` does)."""
    os.setsid()  # its own session and process group, as torchrun starts a worker (start_new_session)
    stdin, stdout, stderr, watch = req["fds"]
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    # the trampoline holds the pipe's other end: when it dies (SIGKILL included), the kernel sends this process
    # SIGIO, whose default action ends it, so a rank never outlives the process torchrun watches
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(watch, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(watch, fcntl.F_SETFL, fcntl.fcntl(watch, fcntl.F_GETFL) | os.O_ASYNC | os.O_NONBLOCK)
    # its parent as a fresh worker's: the process that started the trampoline (torchrun's agent, Accelerate's launcher);
    # hfpar names a launch's shared directory by it (hfpar/observe/refusal.py: one refusal line per launch)
    os.getppid = functools.partial(int, req["ppid"])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 -- the interpreter's own stdio, on the request's descriptors
    sys.stdout = _stdio(1, req["unbuffered"])
    sys.stderr = _stdio(2, req["unbuffered"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(sys.stderr)
    random.seed()  # a fresh interpreter seeds from the OS
    old, new = _entries(req["base_pythonpath"]), _entries(os.environ.get("PYTHONPATH", ""))
    if new != old:  # PYTHONPATH's entries follow the script's directory (refusal: none shadows an import here)
        old, new = {os.path.abspath(p) for p in old}, [os.path.abspath(p) for p in new]
        sys.path[1:] = [*new, *(p for p in sys.path[1:] if p not in old and p not in new)]
    sys.argv = list(req["argv"])
    if req["module"]:
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    request = serve(sys.argv[1])
    if request is not None:
        become(request)  # the rank's script: its exit, exceptions included, is this interpreter's own
