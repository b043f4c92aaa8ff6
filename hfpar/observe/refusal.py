"""A refusal reaches the user once, in one line, whichever rank finds it; the other ranks leave without a traceback.

    from hfpar.observe.refusal import fail, guarded
    @guarded                       # the recipe's main: an error that follows a peer's refusal is not news
    def main(...):
        ... fail("--tp_size 3 does not divide the world size 2")     # prints `hfpar: error: ...`, exits 2

The rank that finds a problem prints it itself; ranks that find the same line claim it first in a directory of
this launch on this node (`O_EXCL`: one winner), so it is printed once per node. That directory is used only when
it is private to this user (a real directory of this uid, not writable by others: `_root`), and pruning it never
follows a link. A rank that then fails in a
collective because its peer left sees that a refusal of this launch was said and exits with the same code, quietly.
why: docs/architecture.md#why-spine-and-launch

`hfpar launch` (hfpar/launch.py) is `accelerate launch` with the workers' exit code and no launcher traceback. Under
plain `accelerate launch` / `torchrun` the agent's ChildFailedError (a traceback, exit code 1) follows any non-zero
worker exit and no worker can prevent it; `tell_launcher` makes its summary name the refusal (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

REFUSED_EXIT = 2
PREEMPTED_EXIT = 75  # hfpar.checkpoint.checkpointer's (not imported: the launcher reads this module)
_PRUNE_AFTER_S = 24 * 3600


def _private(path: Path) -> bool:
    """A real directory (not a symlink) of this user that no one else can write into: only then are its entries
    this user's own (another local user can create `<tmp>/hfpar-<uid>-refusals` first, and plant links in it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _root() -> Path | None:
    """Where this user's launches leave their records on this node: `<tmp>/hfpar-<uid>-refusals` (created 0700),
    else `$XDG_RUNTIME_DIR/hfpar-refusals` (a 0700 directory of the user's session) when the first is not private;
    None when neither is (no record: each rank then says its refusal itself). The same answer for the workers and
    for `hfpar launch`, which reads their exit codes there."""
    candidates = [Path(tempfile.gettempdir()) / f"hfpar-{os.getuid()}-refusals"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        candidates.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "hfpar-refusals")
    for root in candidates:
        with contextlib.suppress(OSError):
            os.mkdir(root, 0o700)  # (an existing one is checked as it is: never chmod-ed or followed)
        if _private(root):
            return root
    return None


def agent_dir(agent_pid: int) -> Path | None:
    """What the workers of the launcher (torchrun's agent) `agent_pid` on this node leave for each other and for it;
    None when no private place exists for it (_root)."""
    root = _root()
    return None if root is None else root / f"{socket.gethostname()}-{agent_pid}"


def _attempt() -> str:
    """Refusals are shared within one attempt of a launch (a torchrun restart is a new attempt)."""
    return f"{os.environ.get('MASTER_PORT', '')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-"


def _launch_dir() -> Path | None:
    """This launch's directory on this node: the torchrun agent (the workers' parent process) names it. None
    outside a launcher (one process: nothing to share) or without a private place for it."""
    if "LOCAL_RANK" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    d = agent_dir(os.getppid())
    if d is None:
        return None
    with contextlib.suppress(OSError):  # (an existing one: checked below)
        os.mkdir(d, 0o700)
    if not _private(d):
        return None
    _prune(d.parent, keep=d.name)
    return d


def _prune(root: Path, keep: str) -> None:
    """Old launches' directories (a day old) go; they hold a few bytes each. Nothing is followed: entries are
    lstat-ed, only real directories are opened (O_NOFOLLOW, then read and unlinked by name through that descriptor,
    so a swapped path cannot redirect it), and only the regular files inside them are unlinked."""
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if entry.name == keep or not stat.S_ISDIR(st.st_mode) or now - st.st_mtime <= _PRUNE_AFTER_S:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=fd)
        except OSError:
            pass
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(entry.path)  # fails while anything but its regular files is left in it: it stays


def _claim(d: Path | None, line: str) -> bool:
    """True for the first rank of this launch (on this node) to say `line`."""
    if d is None:
        return True
    name = d / (_attempt() + hashlib.sha1(line.encode()).hexdigest())
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError:
        return True
    with os.fdopen(fd, "w") as fh:
        fh.write(line)
    return True


def say(problems: str, prefix: str = "hfpar: error: ") -> None:
    """Each line of `problems` printed to stderr once per launch and node, by whichever rank gets there first."""
    d = _launch_dir()
    for line in str(problems).splitlines() or [""]:
        if _claim(d, line):
            print(f"{prefix}{line}", file=sys.stderr)
    sys.stderr.flush()


def tell_launcher(problems: str, prefix: str = "hfpar: error: ") -> None:
    """Leave the refusal in this worker's elastic error file (TORCHELASTIC_ERROR_FILE, set by torchrun's agent, also
    inside `accelerate launch`). The agent raises ChildFailedError for any worker that exits non-zero, whatever the
    worker does (its traceback and exit code 1 cannot be avoided from here); with the file, the summary's root cause
    reads `traceback : hfpar: error: ...` instead of a link to torch's docs. The format is the one torch's
    ProcessFailure reads: {"message": str, "timestamp": int}."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = "\n".join(f"{prefix}{line}" for line in str(problems).splitlines() or [""])
    with contextlib.suppress(OSError):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def fail(problems: str, code: int = REFUSED_EXIT):
    """One `hfpar: error:` line per problem (from this rank, once per launch), then exit `code`."""
    say(problems)
    tell_launcher(problems)
    sys.exit(code)


def peer_refused() -> bool:
    """Whether a rank of this launch (on this node) has already said a refusal."""
    d = _launch_dir()
    try:
        return d is not None and any(f.name.startswith(_attempt()) for f in d.iterdir())
    except OSError:
        return False


def record_exit(code: int) -> None:
    """A worker's exit code, for `hfpar launch` (which may itself be the one signalled: preemption)."""
    d = _launch_dir()
    if d is not None:
        with contextlib.suppress(OSError):
            os.close(os.open(d / f"exit-{int(code)}", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def recorded_exits(agent_pid: int) -> set[int]:
    """The exit codes the workers of launcher `agent_pid` recorded (hfpar launch asks for its own pid)."""
    d = agent_dir(agent_pid)
    try:
        return {int(f.name[5:]) for f in d.iterdir() if f.name.startswith("exit-")} if d and _private(d) else set()
    except (OSError, ValueError):
        return set()


def guarded(fn):
    """The recipe's entry: an exception raised after a peer refused (the collective it was in lost that peer) ends
    this rank with the refusal's exit code and no traceback; any other exception propagates as it is."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:  # a refusal (2), a preemption (75): what `hfpar launch` exits with
            if isinstance(exc.code, int) and exc.code:
                record_exit(exc.code)
            if exc.code == PREEMPTED_EXIT:  # for the summary of a launcher that raises (a refusal wrote its line)
                tell_launcher(
                    f"preempted: a checkpoint was saved and the workers exited with code {PREEMPTED_EXIT}; "
                    "relaunch with --resume_from_checkpoint latest",
                    prefix="hfpar: ",
                )
            raise
        except Exception:
            time.sleep(0.2)  # the peer that refused writes its line before it exits: let a racing one finish
            if peer_refused():
                sys.stderr.flush()
                os._exit(REFUSED_EXIT)  # the process group is broken: no clean shutdown is possible
            raise

    return run
