"""A pre-imported `accelerate launch` the suite's launches fork from.

    python tests/helpers/zygote.py        # started once per pytest session by tests/helpers/launch.py

Every launch of the suite used to start a new Python that imports torch and accelerate (about 3 s of CPU, a
quarter of a tiny 2-process launch) only to parse the command line and start the workers. This process imports
them once; for each request (one JSON line on stdin) it forks, and the child runs the same entry point as the
`accelerate launch` command, `accelerate.commands.launch.main()`, with the same argv, in the launch's own
environment and working directory, stdout / stderr to the files named, its exit status written to a file. The
workers it starts are fresh interpreters, exactly as under the command. Nothing here touches torch before the
fork (no thread pool, no CUDA context), so the child starts from a clean state.

A request: {"argv": [...], "env": {...}, "cwd": "...", "out": path, "err": path, "rc": path[, "module":
"hfpar.launch"]} (module: `python -m hfpar.launch ARGS`, hfpar's wrapper of the same launch); the reply line:
{"pid": child pid}. The child leads its own session (its process group is its pid), so a timeout kills the
launcher and its workers together.
"""

from __future__ import annotations

import json
import os
import select
import sys
import traceback

import accelerate.commands.launch as accelerate_launch  # the import this process exists to share


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
    _reap()


if __name__ == "__main__":
    main()
