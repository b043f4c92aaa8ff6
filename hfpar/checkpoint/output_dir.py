"""The run's --output_dir is hfpar's only where hfpar wrote it: one run at a time (a lock), and nothing of the
user's is deleted, replaced or followed.

    lock = claim_output_dir(args)          # before the accelerator: the lock (main process), then check_output_dir
    overwrite_previous_run(args, accelerator)     # --overwrite_output_dir: the previous run moved aside, said
    release_output_dir(lock)               # at the end of the run (also on exit: the OS drops an flock with its
    process)

The lock: `<output_dir>/.hfpar.lock`, held with flock(2) by the main process (global rank 0) for the whole run, its
content host, pid and start time. A second run into the same directory is refused in one line naming the holder.
A lock file left by a process that died (a crash, a kill -9) holds no flock any more: the next run takes it over
and says so. On file systems without flock (some NFS mounts) the lock is advisory only (said once).

What hfpar owns: `checkpoint-<step>/` directories it wrote (a real directory, not a symlink, with its COMPLETE
marker and MANIFEST.json), its own staging dirs `.checkpoint-<step>.tmp/`, and the records / final-model files
it writes at the root. A `checkpoint-<step>` that is anything else (a user's folder, a symlink, a file) is
refused up front: hfpar would otherwise replace it when it saves that step.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from hfpar.checkpoint.layout import (
    MARKER,
    PREVIOUS_RUN,
    has_any_checkpoint,
    is_hfpar_checkpoint,
    previous_run_files,
    resolve_resume,
    set_aside_previous_run,
)
from hfpar.checkpoint.manifest import MANIFEST
from hfpar.config import ConfigError

LOCK_FILE = ".hfpar.lock"
_HELD: dict[str, OutputDirLock] = {}  # output dir (real path) -> the lock this process holds there
_CKPT_PREFIXES = ("checkpoint-", ".checkpoint-")


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# ----------------------------------------------------------------------------------------------------- the lock
class OutputDirLock:
    """flock on <dir>/.hfpar.lock. acquire() -> a one-line note when a stale lock was taken over, else None; raises
    ConfigError naming the holder when another live run holds it."""

    def __init__(self, output_dir: str | os.PathLike):
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_FILE
        self.fd: int | None = None
        self.created_dir = False

    def acquire(self) -> str | None:
        import fcntl  # noqa: PLC0415  (POSIX; hfpar runs on Linux / macOS)

        if self.path.is_symlink():
            raise ConfigError(f"--output_dir {self.dir}: {LOCK_FILE} is a symlink, not hfpar's lock file; remove it")
        self.created_dir = not self.dir.exists()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output_dir {self.dir}: cannot create it ({exc.strerror})") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise ConfigError(
                    f"--output_dir {self.dir}: cannot write its lock file {LOCK_FILE} ({exc.strerror})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read(fd)
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise ConfigError(in_use_line(self.dir, holder)) from None
                note = f"--output_dir {self.dir}: no file locks on this file system ({exc.strerror}): not locked"
                return note
            # the file may have been unlinked by its previous holder between our open and our flock: lock the path's
            # file
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "launch": launch_key(),
                }
            ).encode(),
            0,
        )
        self.fd = fd
        atexit.register(self.release)  # sys.exit (a refusal, a preemption) unlinks it too; a kill leaves it stale
        if stale:
            return (
                f"--output_dir {self.dir}: took over a stale lock of {_describe(stale)} (that process is gone: "
                "its run crashed or was killed; its complete checkpoints are kept)"
            )
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still holding the flock: a waiter re-checks the inode (acquire)
        os.close(self.fd)
        self.fd = None
        if self.created_dir:  # a refused run leaves no empty directory behind
            with contextlib.suppress(OSError):
                self.dir.rmdir()


def launch_key() -> str:
    """The same for every rank of one launch (all nodes), different for two launches running at once."""
    pid = os.getpid() if "MASTER_PORT" not in os.environ else ""
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}:{pid}"


def in_use_line(output_dir, holder: dict | None) -> str:
    return (
        f"--output_dir {output_dir} is in use by another run ({_describe(holder)}; lock "
        f"{Path(output_dir) / LOCK_FILE}): wait for it to finish, or pick another --output_dir"
    )


def held_by_another_launch(output_dir) -> dict | None:
    """For the other ranks (the main process holds the lock): the holder's record when a live process of another
    launch on this host holds the lock (the same refusal as the main process's, said once), else None. Read only:
    a test lock here could make this launch's own main process fail to take it."""
    path = Path(output_dir) / LOCK_FILE
    try:
        holder = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return None
    if (
        not isinstance(holder, dict)
        or holder.get("launch") == launch_key()
        or holder.get("host") != socket.gethostname()
    ):
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except (KeyError, ValueError, ProcessLookupError):
        return None
    except PermissionError:
        pass
    return holder


def _read(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict | None) -> str:
    if not holder or "pid" not in holder:
        return "a process that left no details"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


# --------------------------------------------------------------------------------------------- ownership checks
def foreign_entries(output_dir: str | os.PathLike) -> list[str]:
    """Entries at the output dir's root hfpar would write to but did not write: one line each."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    out = []
    for child in sorted(root.iterdir()):
        name = child.name
        if name.startswith("checkpoint-"):
            if not is_hfpar_checkpoint(child):
                what = (
                    "a symlink"
                    if child.is_symlink()
                    else "a file"
                    if not child.is_dir()
                    else f"a directory without hfpar's {MARKER} marker and {MANIFEST}"
                )
                out.append(
                    f"--output_dir {output_dir}: {name} is {what}, not a checkpoint hfpar wrote; hfpar never "
                    f"deletes or writes into it: move or rename it, or pick another --output_dir"
                )
        elif name.startswith(".checkpoint-") and name.endswith(".tmp"):
            if child.is_symlink() or not child.is_dir():
                out.append(
                    f"--output_dir {output_dir}: {name} is not hfpar's staging directory (a "
                    f"{'symlink' if child.is_symlink() else 'file'}); remove it"
                )
        elif name in PREVIOUS_RUN and (child.is_symlink() or not child.is_file()):
            out.append(
                f"--output_dir {output_dir}: {name} is {'a symlink' if child.is_symlink() else 'not a file'}; "
                "hfpar writes a file of that name there: move it, or pick another --output_dir"
            )
    return out


def check_output_dir(args) -> None:
    """Never write over someone's run (checkpoints, or the final model and metrics of a finished one), nor over
    anything hfpar did not write, without an explicit flag. --overwrite_output_dir: the previous run is set aside
    (after the accelerator exists, by the main process: overwrite_previous_run) and `latest` then means a fresh
    start, never the old run's checkpoints."""
    if args.overwrite_output_dir:
        if args.resume_from_checkpoint == "latest":
            args.resume_from_checkpoint = None
        return
    if args.resume_from_checkpoint not in (None, "latest"):
        resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a bad PATH is named first
    foreign = foreign_entries(args.output_dir)
    if foreign:
        raise ConfigError("\n".join(foreign))
    if has_any_checkpoint(args.output_dir) and not args.resume_from_checkpoint:
        raise ConfigError(
            f"--output_dir {args.output_dir} already holds checkpoints; pass --resume_from_checkpoint latest to "
            "continue or --overwrite_output_dir to start over there (or pick another --output_dir)"
        )
    path = resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a bad PATH fails here, before any work
    left = [f.name for f in previous_run_files(args.output_dir) if not f.name.startswith(_CKPT_PREFIXES)]
    if path is None and left:
        raise ConfigError(
            f"--output_dir {args.output_dir} holds a previous run ({', '.join(left[:3])}) and no checkpoint "
            "to resume; pass --overwrite_output_dir to replace it (it is moved aside), or pick another "
            "--output_dir"
        )


def claim_output_dir(args) -> OutputDirLock | None:
    """The main process locks the output dir (the lock first: two runs never both pass the checks below), then
    every rank checks it. Raises ConfigError (one line per problem)."""
    lock = None
    if _is_main():
        key = os.path.realpath(args.output_dir)
        if key in _HELD:  # this process's earlier run there ended by an exception (runs of a process are sequential)
            _HELD.pop(key).release()
        lock = _HELD[key] = OutputDirLock(args.output_dir)
        note = lock.acquire()
        if note:
            print(f"hfpar: warning: {note}", file=sys.stderr)
    elif (holder := held_by_another_launch(args.output_dir)) is not None:
        raise ConfigError(in_use_line(args.output_dir, holder))
    try:
        check_output_dir(args)
    except ConfigError:
        release_output_dir(lock)
        raise
    return lock


def release_output_dir(lock: OutputDirLock | None) -> None:
    if lock is not None:
        lock.release()
        if _HELD.get(os.path.realpath(lock.dir)) is lock:
            del _HELD[os.path.realpath(lock.dir)]


def overwrite_previous_run(args, accelerator) -> None:
    """--overwrite_output_dir: the main process moves the previous run aside, said in one line; every rank waits."""
    if args.overwrite_output_dir and accelerator.is_main_process:
        dest = set_aside_previous_run(args.output_dir)
        if dest is not None:
            print(
                f"hfpar: --overwrite_output_dir: the previous run's checkpoints and records in {args.output_dir} were "
                f"moved to {dest} (delete it to free the space)",
                file=sys.stderr,
            )
    accelerator.wait_for_everyone()
