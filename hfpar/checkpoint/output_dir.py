"""The run's --output_dir is hfpar's only where hfpar wrote it: one run at a time (a lock), and nothing of the
user's is deleted, replaced or followed.

    lock = claim_output_dir(args)          # before the accelerator: the lock (main process), then check_output_dir
    overwrite_previous_run(args, accelerator)     # --overwrite_output_dir, once the preflight and the data passed:
                                                  # the previous run moved aside, said
    release_output_dir(lock)               # at the end of the run (also on exit: the OS drops an flock with its
    process)

The lock: `<output_dir>/.hfpar.lock`, held with flock(2) by the main process (global rank 0) for the whole run, its
content host, pid and start time. A second run into the same directory is refused in one line naming the holder.
A lock file left by a process that died (a crash, a kill -9) holds no flock any more: the next run takes it over
and says so. On file systems without flock (some NFS mounts) the lock is advisory only (said once).

What hfpar owns (ownership.py): `checkpoint-<step>/` directories it wrote (a real directory, not a symlink, with its
COMPLETE marker and MANIFEST.json), its own staging dirs, and the records / final-model files it wrote at the root
of a directory it claimed (its ledger). Anything else there (a user's file or folder, any symlink) is refused up
front in one line naming it, unless --overwrite_output_dir; even then a symlink, a user's `checkpoint-<step>` or a
folder named like hfpar's staging dirs is refused (hfpar would write through, move or delete it), and so is an
output dir that is, holds or lies inside the model (or tokenizer) directory.
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

from hfpar.checkpoint.layout import has_any_checkpoint, previous_run_files, resolve_resume
from hfpar.checkpoint.ownership import (
    CKPT_RE,
    LEDGER,
    LOCK_FILE,
    REPLACED,
    STAGING_RE,
    foreign,
    owned_names,
    record_written,
    root_names,
    set_aside,
    user_names,
)
from hfpar.config import ConfigError

_HELD: dict[str, OutputDirLock] = {}  # output dir (real path) -> the lock this process holds there


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
        self.before: set[str] | None = None  # root entries when the run was accepted (accept)

    def accept(self) -> None:
        """The checks passed: the ledger written (the dir is claimed by hfpar), what is there now remembered: what
        appears from here on under the lock is this run's (release lists it)."""
        self.before = root_names(self.dir)
        user = {n for n, _ in foreign_entries(self.dir)}  # accepted under --overwrite_output_dir: still the user's
        record_written(self.dir, self.before, user=user)

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
                f"--output_dir {self.dir}: took over a stale lock of {_describe(stale)} (no process holds it any "
                "more: its run crashed or was killed; its complete checkpoints are kept)"
            )
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        if self.before is not None:
            if root_names(self.dir) - {LOCK_FILE, LEDGER}:
                record_written(self.dir, self.before)  # what this run wrote: hfpar's, listed
            else:  # nothing there (a refusal): no claim left behind
                with contextlib.suppress(OSError):
                    (self.dir / LEDGER).unlink()
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
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except (KeyError, ValueError, TypeError, ProcessLookupError):
        return None
    except PermissionError:
        pass
    holders = flock_holders(path)
    if holders is not None and pid not in holders:
        return None  # its pid lives on in another process, none holds the lock: stale, the main process takes it over
    return holder


def flock_holders(path: Path) -> set[int] | None:
    """The pids holding an flock on path's file (Linux: /proc/locks), or None where that cannot be read. The main
    process decides by flock itself; the other ranks ask this, so that all decide alike."""
    try:
        st = os.stat(path, follow_symlinks=False)
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want:  # (blocked waiters are "->" lines: not holders)
            with contextlib.suppress(ValueError):
                pids.add(int(f[4]))
    return pids


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
def foreign_entries(output_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(name, why) of each root entry of output_dir hfpar did not write (ownership.foreign), sorted."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    owner, user = owned_names(root), user_names(root)
    return [(c.name, why) for c in sorted(root.iterdir()) if (why := foreign(c, owner, user)) is not None]


def _blocks_overwrite(name: str, why: str) -> bool:
    """What --overwrite_output_dir still refuses: hfpar would write through it (a symlink), move a user's folder of a
    checkpoint's name, delete one of a staging dir's name, or write a file where a folder is."""
    return (
        why != "not written by hfpar"
        or bool(CKPT_RE.match(name) or STAGING_RE.match(name))
        or name in (LOCK_FILE, LEDGER, REPLACED)
    )


def _listing(entries: list[tuple[str, str]]) -> str:
    shown = [f"{n} ({w})" for n, w in entries[:8]]
    return ", ".join(shown) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")


def path_problem(output_dir) -> str | None:
    """An output dir name hfpar cannot write into its JSON records (not UTF-8): refused before anything is written."""
    try:
        str(output_dir).encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"--output_dir {str(output_dir)!a} is not valid UTF-8 (an undecodable byte at character {exc.start}); "
            "hfpar records the path in its JSON files: pick a UTF-8 name"
        )
    return None


def model_dir_overlap(args) -> str | None:
    """--output_dir equal to, inside or holding a local model / tokenizer directory the run reads: refused even with
    --overwrite_output_dir (setting the previous run aside would move the model's own files)."""
    out = os.path.realpath(args.output_dir)
    for option in ("model_name_or_path", "tokenizer_path"):
        value = getattr(args, option, None)
        if not value or not os.path.isdir(value):
            continue
        src = os.path.realpath(value)
        if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
            how = "is" if out == src else "lies inside" if out.startswith(src + os.sep) else "holds"
            return (
                f"--output_dir {args.output_dir} {how} the --{option} directory {value}: hfpar would write (and with "
                "--overwrite_output_dir move) files there; pick an --output_dir outside it"
            )
    return None


def check_output_dir(args) -> None:
    """Never write over someone's run (checkpoints, or the final model and metrics of a finished one), nor over
    anything hfpar did not write, without an explicit flag. --overwrite_output_dir: the previous run is set aside
    (after the preflight, by the main process: overwrite_previous_run) and `latest` then means a fresh start, never
    the old run's checkpoints."""
    foreign_ = foreign_entries(args.output_dir)
    if args.overwrite_output_dir:
        blocking = [(n, w) for n, w in foreign_ if _blocks_overwrite(n, w)]
        if blocking:
            raise ConfigError(
                f"--output_dir {args.output_dir} holds {_listing(blocking)}, not hfpar's: even with "
                "--overwrite_output_dir hfpar never writes through a symlink nor moves or deletes a folder it did not "
                "write; move them out, or pick another --output_dir"
            )
        if args.resume_from_checkpoint == "latest":
            args.resume_from_checkpoint = None
        elif args.resume_from_checkpoint and os.path.realpath(args.resume_from_checkpoint).startswith(
            os.path.realpath(args.output_dir) + os.sep
        ):
            raise ConfigError(
                f"--resume_from_checkpoint {args.resume_from_checkpoint} lies in --output_dir {args.output_dir}, "
                "which --overwrite_output_dir sets aside: resume without --overwrite_output_dir, or copy it elsewhere"
            )
        return
    if args.resume_from_checkpoint not in (None, "latest"):
        resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a bad PATH is named first
    if foreign_:
        raise ConfigError(
            f"--output_dir {args.output_dir} holds what hfpar did not write: {_listing(foreign_)}; hfpar never "
            "overwrites, deletes or writes through them: move them out, pick another --output_dir, or pass "
            "--overwrite_output_dir (hfpar's previous run there is moved aside, files of the names it writes replaced)"
        )
    if has_any_checkpoint(args.output_dir) and not args.resume_from_checkpoint:
        raise ConfigError(
            f"--output_dir {args.output_dir} already holds checkpoints; pass --resume_from_checkpoint latest to "
            "continue or --overwrite_output_dir to start over there (or pick another --output_dir)"
        )
    path = resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a bad PATH fails here, before any work
    left = [
        f.name for f in previous_run_files(args.output_dir) if not (CKPT_RE.match(f.name) or STAGING_RE.match(f.name))
    ]
    if path is None and left:
        raise ConfigError(
            f"--output_dir {args.output_dir} holds a previous run ({', '.join(left[:3])}) and no checkpoint "
            "to resume; pass --overwrite_output_dir to replace it (it is moved aside), or pick another "
            "--output_dir"
        )


def claim_output_dir(args) -> OutputDirLock | None:
    """The main process locks the output dir (the lock first: two runs never both pass the checks below), then
    every rank checks it. Raises ConfigError (one line per problem)."""
    problems = [p for p in (path_problem(args.output_dir), model_dir_overlap(args)) if p]
    if problems:  # what the names alone say, before the lock creates anything
        raise ConfigError(problems[0])
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
    if lock is not None:  # accepted: the dir is hfpar's claim from now on (its ledger), what is there now is known
        lock.accept()
    return lock


def release_output_dir(lock: OutputDirLock | None) -> None:
    if lock is not None:
        lock.release()
        if _HELD.get(os.path.realpath(lock.dir)) is lock:
            del _HELD[os.path.realpath(lock.dir)]


def overwrite_previous_run(args, accelerator) -> None:
    """--overwrite_output_dir: the main process moves the previous run aside, said in one line; every rank waits."""
    if args.overwrite_output_dir and accelerator.is_main_process:
        dest = set_aside(args.output_dir)
        if dest is not None:
            print(
                f"hfpar: --overwrite_output_dir: the previous run's checkpoints and records in {args.output_dir} were "
                f"moved to {dest} (delete it to free the space)",
                file=sys.stderr,
            )
    accelerator.wait_for_everyone()
