"""What a local model / tokenizer / dataset directory may make hfpar or transformers read: only what is inside it.

    problems = escape_problems("path/to/model", option="--model_name_or_path")   # one line per directory, or []
    problem = index_entry_problem("../outside/model.safetensors")                # why an index entry is refused

A directory the user names is untrusted: a `model.safetensors` (or tokenizer.json, chat template, config...) that
is a symlink to `../elsewhere`, or an index whose weight_map names `../outside/x.safetensors` or `/abs/x`, would make
the run train on (or leak into its outputs) files the user never named. Every entry of the directory a loader may
open (its top-level entries of the kinds loaders read, READ_SUFFIXES / READ_PREFIXES, and
`additional_chat_templates/`) must resolve inside it, and every index
entry must be a relative name without `..` that stays inside.

One exception, by design of the Hugging Face cache: a snapshot directory (`.../models--org--name/snapshots/<rev>/`)
holds symlinks `file -> ../../blobs/<hash>`; there the bound is the repository's cache folder (`models--org--name`).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from hfpar.loading.json_limits import read_json

SUBDIRS_READ = ("additional_chat_templates",)  # transformers reads the templates in there next to the tokenizer
# what a model / tokenizer loader opens at a directory's top level: configs, indexes, weights, tokenizer and
# sentencepiece / tiktoken vocabularies, chat templates, custom code; other entries (a run's logs, a README) are not
READ_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".jinja", ".py", ".tiktoken")
READ_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece")
CACHE_PREFIXES = ("models--", "datasets--")  # huggingface_hub's repo folders: <prefix><org>--<name>


def bound(root: Path) -> Path:
    """The folder nothing read through `root` may leave: `root` resolved, or the HF cache repo folder it is a
    snapshot of."""
    r = root.resolve()
    if r.parent.name == "snapshots" and r.parent.parent.name.startswith(CACHE_PREFIXES):
        return r.parent.parent
    return r


def outside(path: Path, limit: Path) -> bool:
    """Whether `path` (followed through every link) resolves outside `limit` (a resolved folder)."""
    return not path.resolve().is_relative_to(limit)


def index_entry_problem(entry: object) -> str | None:
    """Why an index's weight_map value is refused (None: a relative name that cannot climb out)."""
    if not isinstance(entry, str) or not entry:
        return f"{entry!r} is not a file name"
    if os.path.isabs(entry) or PureWindowsPath(entry).is_absolute() or entry.startswith(("/", "\\")):
        return f"{entry!r} is an absolute path"
    if ".." in PurePosixPath(entry.replace("\\", "/")).parts:
        return f"{entry!r} climbs out with '..'"
    return None


def _entries(root: Path, walk: bool):
    """The entries a loader may open: the top level's (READ_SUFFIXES / READ_PREFIXES) and SUBDIRS_READ (a model /
    tokenizer dir), or every entry below `root` (walk: a dataset dir, whose files hfpar's loader finds with rglob).
    Links are not followed."""
    if walk:
        for folder, dirs, files in os.walk(root):  # (os.walk does not descend into linked directories)
            yield from (Path(folder, n) for n in sorted(dirs + files))
        return
    for sub in ("", *SUBDIRS_READ):
        folder = root / sub
        if sub and (folder.is_symlink() or not folder.is_dir()):
            if folder.is_symlink():
                yield folder  # a linked subfolder of templates is itself the way out
            continue
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        yield from (folder / n for n in names if sub or n.endswith(READ_SUFFIXES) or n.startswith(READ_PREFIXES))


def _links_out(root: Path, limit: Path, walk: bool) -> list[str]:
    """The links below `root` that resolve outside `limit`, each with its target (a plain entry below a real
    directory is inside by construction)."""
    return [
        f"{p.relative_to(root)} -> {p.resolve()}" for p in _entries(root, walk) if p.is_symlink() and outside(p, limit)
    ]


def _index_escapes(root: Path, limit: Path) -> list[str]:
    """Entries of the directory's *.index.json weight maps that are absolute, climb out, or resolve outside."""
    found = []
    for index in sorted(root.glob("*.index.json")):
        data, problem = read_json(index)
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if problem or not isinstance(wmap, dict):
            continue  # a malformed index: the weight checks say so
        for entry in sorted(set(map(str, wmap.values()))):
            why = index_entry_problem(entry) or (
                f"{entry!r} -> {(root / entry).resolve()}" if outside(root / entry, limit) else None
            )
            if why:
                found.append(f"{index.name}: {why}")
                break  # one per index: the rest of a crafted map says nothing more
    return found


def escape_problems(path: str | None, *, option: str, walk: bool = False) -> list[str]:
    """One line if a local directory's files (links, index entries) reach outside it; [] for a hub id or a file.
    The path named itself may be a link (the user named it); what is inside it may not lead out."""
    if not path:
        return []
    root = Path(path).expanduser()
    if not root.is_dir():
        return []
    limit = bound(root)
    found = _links_out(root, limit, walk) + ([] if walk else _index_escapes(root, limit))
    if not found:
        return []
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return [
        f"{option} {path}: {'; '.join(found[:3])}{more}: outside the directory you named; hfpar reads only files "
        "inside it (copy those files in, or name the directory that holds them)"
    ]
