"""MANIFEST.json of a checkpoint: every file's size and SHA-256, written last, checked before anything is read.

    write_manifest(ckpt_dir)      # after every file of the checkpoint is written and flushed
    problem = verify(ckpt_dir)    # None, or one line naming the first file that is missing / truncated / altered

A checkpoint whose weights, optimizer, trainer-state or RNG file was truncated, deleted or replaced after it was
written fails verify(); `latest` then falls back to the previous checkpoint that verifies (layout.resolve_resume).
Symlinks are never part of a checkpoint (a link inside one could point anywhere on the disk): verify refuses them.
Hashing reads every byte once (about 1 GB/s per core): the price of knowing the state is the one that was written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath

MANIFEST = "MANIFEST.json"
STAGING_MARK = ".hfpar-staging"  # first file of a staging dir hfpar creates (hfpar.checkpoint.ownership)
# the manifest itself, the marker written after it, and the staging mark removed after it
_SKIP = {MANIFEST, "COMPLETE", STAGING_MARK}


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.parent == root and name in _SKIP:
                continue
            out.append(p)
    return out


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(root: str | os.PathLike) -> dict:
    root = Path(root)
    files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": file_hash(p)} for p in _files(root)}
    manifest = {"format": 1, "files": files}
    with open(root / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return manifest


def symlink_problem(root: str | os.PathLike) -> str | None:
    """A symlink anywhere inside a checkpoint (it could point anywhere on the disk): refused, manifest or not."""
    for p in Path(root).rglob("*"):
        if p.is_symlink():
            return f"{p}: a symlink inside a checkpoint, refused"
    return None


def entry_problem(rel) -> str | None:
    """Why a manifest entry is not a plain relative path inside the checkpoint, or None."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return "is not a relative path"
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or p.as_posix() != rel:
        return "points outside the checkpoint (absolute, '..' or not normalized)"
    return None


def verify(root: str | os.PathLike) -> str | None:
    """None when every file listed is there with its size and hash and nothing else was added; else one line."""
    root = Path(root)
    mpath = root / MANIFEST
    if not mpath.is_file():
        return f"{mpath}: missing (a checkpoint is verified by its manifest, written last)"
    try:
        files = json.loads(mpath.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{mpath}: unreadable"
    if not isinstance(files, dict):
        return f"{mpath}: unreadable ('files' is not an object)"
    if problem := symlink_problem(root):
        return problem
    for rel, want in files.items():  # untrusted: an entry naming a file elsewhere would have it hashed
        if (bad := entry_problem(rel)) or not isinstance(want, dict):
            return f"{mpath}: entry {str(rel)[:120]!r} {bad or 'has no size and hash'}; not hfpar's manifest"
    present = {p.relative_to(root).as_posix() for p in _files(root)}
    for extra in sorted(present - set(files)):
        return f"{root / extra}: not in the checkpoint's manifest (added after it was written)"
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            return f"{p}: missing"
        size = p.stat().st_size
        if size != want.get("size"):
            return f"{p}: {size} bytes, the manifest says {want.get('size')} (truncated or replaced)"
        if file_hash(p) != want.get("sha256"):
            return f"{p}: content differs from the manifest's hash (altered after it was written)"
    return None
