"""A pre-imported `accelerate launch` the suite's launches fork from.

    python tests/helpers/zygote.py RANKS_DIR COUNT   # started once per pytest session by tests/helpers/launch.py

Every launch of the suite used to start a new Python that imports torch and accelerate (about 3 s of CPU, a
quarter of a tiny 2-process launch) only to parse the command line and start the workers. This process imports
them once; for each request (one JSON line on stdin) it forks, and the child runs the same entry point as the
`accelerate launch` command, `accelerate.commands.launch.main()`, with the same argv, in the launch's own
environment and working directory, stdout / stderr to the files named, its exit status written to a file. The
workers it starts fork in turn from the rank zygotes this process starts in RANKS_DIR (tests/helpers/
rank_zygote.py: its `sys.executable` is their trampoline), or are fresh interpreters where a rank zygote refuses
(HFPAR_TEST_RANKS=fresh: always). Nothing here touches torch before the fork (no thread pool, no CUDA context), so
the child starts from a clean state.

A request: {"argv": [...], "env": {...}, "cwd": "...", "out": path, "err": path, "rc": path[, "module":
"hfpar.launch" | "torch.distributed.run"]} (module: `python -m hfpar.launch ARGS`, hfpar's wrapper of the same launch,
or torchrun); the reply line:
{"pid": child pid}. The child leads its own session (its process group is its pid), so a timeout kills the
launcher (torchrun starts each worker in a session of its own: a worker still running is left to its own
collective timeout, as it was before the rank zygotes).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import traceback

import accelerate.commands.launch as accelerate_launch  # the import this process exists to share

HERE = os.path.dirname(os.path.abspath(__file__))


class _Ranks:
    """`count` rank zygotes in `folder` (tests/helpers/rank_zygote.py), one per local rank (rank k uses zygote
    k % count) with its own PYTHONHASHSEED, and the trampoline a launch starts its ranks with
    (tests/helpers/rank_trampoline.py). HFPAR_TEST_RANKS=fresh: none, every rank a fresh interpreter."""

    def __init__(self, folder: str, count: int):
        self.dir = folder
        self.count = count
        self.procs = []
        # a shebang line holds the interpreter's path: one with a space, or one too long for the kernel's line
        # (127 bytes before Linux 5.1), cannot start the trampoline; every rank is then a fresh interpreter
        if os.environ.get("HFPAR_TEST_RANKS") == "fresh" or " " in sys.executable or len(sys.executable) > 100:
            self.python = None
            return
        for k in range(count):
            env = {**os.environ, "PYTHONHASHSEED": str(secrets.randbelow(2**32 - 1) + 1)}
            server = [sys.executable, os.path.join(HERE, "rank_zygote.py"), os.path.join(self.dir, f"rank-{k}.sock")]
            with open(os.path.join(self.dir, f"rank-{k}.out"), "w") as out:  # its imports' warnings, once
                self.procs.append(
                    subprocess.Popen(server, env=env, stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=os.getcwd())
                )
        self.python = os.path.join(self.dir, "python")
        with open(self.python, "w") as f:  # an interpreter path for torchrun / Accelerate: the trampoline
            f.write(
                f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {HERE!r})\nimport rank_trampoline\n"
                f"rank_trampoline.main({sys.executable!r})\n"
            )
        os.chmod(self.python, 0o755)

    def use_in_launcher(self) -> None:
        """In a launch's process (forked from here): its ranks start through the trampoline."""
        for proc in self.procs:  # the zygotes see their stdin close when this process's parent ends, not later
            proc.stdin.close()
        if self.python is not None and os.environ.get("HFPAR_TEST_RANKS") != "fresh":
            sys.executable = self.python
            os.environ["HFPAR_TEST_RANK_ZYGOTES"] = f"{self.dir}:{self.count}"

    def close(self) -> None:
        for proc in self.procs:  # a zygote ends when its stdin closes (one still importing: after its imports)
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


RANKS: _Ranks | None = None


def _exit_status(e: SystemExit) -> int:
    # Python's own rule for `sys.exit(code)`: None -> 0, an int -> itself, anything else is printed -> 1
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run_child(req: dict) -> None:
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    RANKS.use_in_launcher()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["accelerate-launch", *req["argv"]]
    try:
        if req.get("module") == "hfpar.launch":  # `hfpar launch`: the same launch, the workers' exit code
            from hfpar.launch import main as hfpar_launch  # noqa: PLC0415  (in the child: hfpar as the launch's env has it)

            hfpar_launch(req["argv"])
        elif req.get("module") == "torch.distributed.run":  # torchrun: the examples' and own-code launches
            from torch.distributed.run import main as torchrun  # noqa: PLC0415  (imported by accelerate already)

            torchrun(req["argv"])
        else:
            accelerate_launch.main()
        rc = 0
    except SystemExit as e:
        rc = _exit_status(e)
    except BaseException:  # noqa: BLE001 -- an uncaught exception ends the real command so: traceback, status 1
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    with open(req["rc"] + ".tmp", "w") as f:
        f.write(str(rc))
    os.replace(req["rc"] + ".tmp", req["rc"])
    os._exit(rc)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    global RANKS
    RANKS = _Ranks(sys.argv[1], int(sys.argv[2]))
    stdin = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.5)
        _reap()
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:  # the test session ended
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _run_child(req)
                finally:  # whatever happened, the child never returns into this loop
                    os._exit(1)
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()
    RANKS.close()
    _reap()


if __name__ == "__main__":
    main()
