"""The Python torchrun / Accelerate start a test launch's ranks with (tests/helpers/zygote.py makes it the launcher's
`sys.executable`): `TRAMPOLINE [-u] script.py ARGS` or `TRAMPOLINE [-u] -m module ARGS`.

It asks the rank zygote of its LOCAL_RANK (tests/helpers/rank_zygote.py) to fork the rank with this process's argv,
environment, working directory and stdin / stdout / stderr, forwards the signals it receives to that rank, and
ends as the rank ended (its exit code, or killed by its signal), so the launcher sees what it would see of a fresh
interpreter. Anything it cannot hand over (another interpreter option, no zygote yet, an environment the zygote
refuses) runs the real interpreter in its place (exec), exactly the command without the zygotes. Standard library
only: it starts with `python -S` in ~20 ms.
"""

import json
import os
import signal
import socket
import sys

ZYGOTES = "HFPAR_TEST_RANK_ZYGOTES"  # "<dir>:<count>", set in the launcher only: never part of a rank's environment
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def fresh(python: str, args: list) -> None:
    os.execv(python, [python, *args])  # the command as it would have run: a new interpreter


def _readline(sock: socket.socket) -> dict | None:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return json.loads(buf)


def _end_as(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default
    os._exit(os.waitstatus_to_exitcode(status))


def main(python: str) -> None:
    args = sys.argv[1:]
    where = os.environ.pop(ZYGOTES, "")
    unbuffered = args[:1] == ["-u"]
    rest = args[1:] if unbuffered else args
    module = rest[:1] == ["-m"]
    argv = rest[1:] if module else rest
    if not where or not argv or (not module and argv[0].startswith("-")):
        fresh(python, args)
    folder, count = where.rsplit(":", 1)
    path = os.path.join(folder, f"rank-{int(os.environ.get('LOCAL_RANK', '0')) % int(count)}.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # not started yet (it imports for ~10 s) or gone
        fresh(python, args)
    watch_r, watch_w = os.pipe()
    req = {
        "argv": argv,
        "module": module,
        "unbuffered": unbuffered,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "ppid": os.getppid(),  # the process that started this one (torchrun's agent): the rank's parent as it sees it
    }
    socket.send_fds(sock, [json.dumps(req).encode()], [0, 1, 2, watch_r])
    os.close(watch_r)
    reply = _readline(sock)
    if reply is None or "pid" not in reply:
        sock.close()
        os.close(watch_w)
        fresh(python, args)
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    done = _readline(sock)
    if done is None:
        print(f"rank_trampoline: the rank zygote ended before rank {pid} did", file=sys.stderr)
        os._exit(1)
    _end_as(done["status"])
