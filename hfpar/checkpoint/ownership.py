"""What in an --output_dir hfpar wrote, and so may replace, move or delete: everything else there is the user's.

    owner = owned_names("out")          # None: no hfpar run ever claimed "out"; else the entries hfpar wrote itself
    record_written("out", before)       # main process: after a claim, each save and at the end of the run
    foreign(entry, owner)               # why an entry is not hfpar's to touch (one phrase), or None

How hfpar recognises its own: the ledger `<output_dir>/.hfpar.owned.json` (written by the main process, which holds
the run's lock) lists the root entries hfpar created itself; it is rewritten after every checkpoint save and at the
end of the run. A run killed between two saves leaves records (metrics.jsonl, ...) the ledger does not list yet: the
names hfpar writes at the root are recognised in a directory hfpar claimed before. Self-identifying: a
checkpoint-<step> with COMPLETE and MANIFEST.json, a staging dir `.checkpoint-<step>.tmp/` holding STAGING_MARK
(written first into it: a user's directory of that name has none). A symlink is never hfpar's (it never writes one):
it is never followed, written through or deleted. Only what the ledger lists is ever deleted (retention), so a
checkpoint the user copied in to resume from is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from hfpar.checkpoint.layout import MARKER, PREVIOUS_RUN, is_hfpar_checkpoint
from hfpar.checkpoint.manifest import MANIFEST, STAGING_MARK  # (the mark is never part of a manifest)

LEDGER = ".hfpar.owned.json"
LOCK_FILE = ".hfpar.lock"
REPLACED = ".replaced"
CKPT_RE = re.compile(r"^checkpoint-\d+$")
STAGING_RE = re.compile(r"^\.(checkpoint-\d+|final-model)\.tmp$")
# files of a final model save_pretrained / a tokenizer or processor writes at the root (a run killed while exporting
# leaves some the ledger does not list yet)
_FINAL_RE = re.compile(
    r"^(model-\d+-of-\d+\.safetensors|tokenizer.*\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)"
    r"|merges\.txt|.*\.model|chat_template\.(jinja|json)|(pre)?processor_config\.json|video_preprocessor_config\.json"
    r"|README\.md)$"
)


def _ledger(root: Path) -> dict | None:
    f = root / LEDGER
    if not f.is_file() or f.is_symlink():
        return None
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # hfpar's ledger, damaged: claimed, nothing listed (nothing deleted)
    return d if isinstance(d, dict) else {}


def _names(d: dict | None, key: str) -> set[str]:
    v = (d or {}).get(key)
    return {n for n in v if isinstance(n, str)} if isinstance(v, list) else set()


def user_names(output_dir: str | os.PathLike) -> set[str]:
    """Entries the user had in the dir when a run accepted it under --overwrite_output_dir: never taken for hfpar's
    (even under a name hfpar writes), until hfpar replaces one itself."""
    return _names(_ledger(Path(output_dir)), "user")


def owned_names(output_dir: str | os.PathLike) -> set[str] | None:
    """The root entries hfpar wrote in output_dir (its ledger), or None when no hfpar run claimed it. A directory of a
    run older than the ledger (its records run_info.json / metrics.jsonl, no ledger) counts as claimed, with nothing
    listed: its entries are recognised by name, and none is ever deleted by retention."""
    root = Path(output_dir)
    d = _ledger(root)
    if d is not None:
        return _names(d, "written")
    records = [root / "run_info.json", root / "metrics.jsonl"]
    return set() if any(f.is_file() and not f.is_symlink() for f in records) else None


def root_names(output_dir: str | os.PathLike) -> set[str]:
    root = Path(output_dir)
    return {c.name for c in root.iterdir()} if root.is_dir() else set()


def record_written(
    output_dir: str | os.PathLike,
    before: set[str] | None = None,
    add: tuple[str, ...] = (),
    user: set[str] | None = None,
) -> None:
    """Main process (holding the lock): the ledger := what it listed, plus `add` (a checkpoint just saved), plus every
    root entry that appeared since the claim (`before`: the entries present then), minus those gone; `user`: the
    user's entries accepted at the claim (--overwrite_output_dir). Best effort: a failed write costs recognition only
    (what is unlisted is never deleted)."""
    root = Path(output_dir)
    if not root.is_dir():
        return
    now = {n for n in root_names(root) if not (root / n).is_symlink()}
    listed = owned_names(root) or set()
    new = now - before if before is not None else set()
    written = sorted(((listed | set(add) | new) & now) - {LEDGER, LOCK_FILE, f"{LEDGER}.tmp"})
    users = sorted(((user_names(root) | (user or set())) & now) - set(add) - new)
    tmp = root / f"{LEDGER}.tmp"
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"format": 1, "written": written, "user": users}, fh)
        os.replace(tmp, root / LEDGER)  # replaces a link of that name, never writes through it


def is_staging(path: Path) -> bool:
    """A staging dir hfpar created (a real directory holding its mark)."""
    return not path.is_symlink() and path.is_dir() and (path / STAGING_MARK).is_file()


def foreign(entry: Path, owner: set[str] | None, user: set[str] = frozenset()) -> str | None:
    """Why entry (a child of the output dir) is not hfpar's, as a short phrase, or None when hfpar wrote it. owner:
    owned_names; user: user_names."""
    name = entry.name
    if entry.is_symlink():
        return "a symlink"
    if name in (LOCK_FILE, LEDGER, f"{LEDGER}.tmp"):
        return None if entry.is_file() else "not a file"
    if CKPT_RE.match(name):
        if is_hfpar_checkpoint(entry):
            return None  # self-identifying (a checkpoint copied in to resume from is read, never deleted)
        return "a file" if not entry.is_dir() else f"a directory without hfpar's {MARKER} marker and {MANIFEST}"
    if STAGING_RE.match(name):
        return None if is_staging(entry) else f"{'a directory' if entry.is_dir() else 'a file'} hfpar did not stage"
    if name == REPLACED:
        return "not a directory" if not entry.is_dir() else None if owner is not None else "not written by hfpar"
    if name in user:
        return "not written by hfpar"
    if name in PREVIOUS_RUN or _FINAL_RE.match(name):  # hfpar writes a file of that name there
        return "not a file" if not entry.is_file() else None if owner is not None else "not written by hfpar"
    if owner is not None and name in owner:
        return None
    return "not written by hfpar"


def set_aside(output_dir: str | os.PathLike) -> Path | None:
    """--overwrite_output_dir: every root entry hfpar wrote (checkpoints, records, final model, staging dirs) moved
    into <output_dir>/.replaced/<UTC time>-<pid>[-n]/, a new directory each time (never merged into an earlier
    set-aside); the user's own entries stay where they are. Returns that dir, or None if there was nothing."""
    root = Path(output_dir)
    owner, user = owned_names(root), user_names(root)
    keep = {LOCK_FILE, LEDGER, REPLACED, f"{LEDGER}.tmp"}
    entries = sorted(root.iterdir()) if root.is_dir() else []
    mine = [c for c in entries if c.name not in keep and foreign(c, owner, user) is None]
    if not mine:
        return None
    parent = root / REPLACED
    parent.mkdir(exist_ok=True)
    if parent.is_symlink() or not parent.is_dir():  # the claim refuses it; appeared since: never moved through
        raise OSError(f"{parent} is not a directory hfpar made")
    stamp = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    for n in range(1000):
        dest = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            dest.mkdir()
            break
        except FileExistsError:
            continue
    for c in mine:
        os.replace(c, dest / c.name)  # a rename: a link would move as a link (none is hfpar's anyway)
    return dest
