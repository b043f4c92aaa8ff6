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
from pathlib import Path

MANIFEST = "MANIFEST.json"
_SKIP = {MANIFEST, "COMPLETE"}  # the manifest itself and the marker written after it


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
    for p in root.rglob("*"):
        if p.is_symlink():
            return f"{p}: a symlink inside a checkpoint, refused"
    present = {p.relative_to(root).as_posix() for p in _files(root)}
    for extra in sorted(present - set(files)):
        return f"{root / extra}: not in the checkpoint's manifest (added after it was written)"
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            return f"{p}: missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{p}: {size} bytes, the manifest says {want['size']} (truncated or replaced)"
        if file_hash(p) != want["sha256"]:
            return f"{p}: content differs from the manifest's hash (altered after it was written)"
    return None
