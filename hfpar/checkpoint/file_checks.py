"""Files a user points a run at, checked before any work (the preflight calls these): one line each, naming the file.

    weights_problems("path/to/model")   # weight files missing, truncated, or a shard of the index absent
    data_file_problems("data.jsonl")    # a text data file that is not UTF-8: the file and the byte offset

Cheap: safetensors headers and zip directories are read, not the tensors; data files are decoded once in 1 MiB
blocks (no tokenization). A hub id (not a local path) is left to the loader.
"""

from __future__ import annotations

import codecs
import json
import struct
import zipfile
from pathlib import Path

TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".txt", ".tsv")


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                return f"{path}: truncated or not safetensors ({size} bytes, its header alone says {n + 8})"
            header = json.loads(fh.read(n))
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"{path}: not a safetensors file (unreadable header)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"{path}: truncated: {size} bytes, its header says {8 + n + end}"
    return None


def _bin_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{path}: truncated or not a torch zip checkpoint (its directory is unreadable)"


def weights_problems(model_dir: str | Path) -> list[str]:
    """Problems of a local model directory's weight files (none for a hub id or a dir with only a config)."""
    root = Path(model_dir)
    if not root.is_dir() or not (root / "config.json").is_file():
        return []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = root / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError):
                return [f"{index}: unreadable index"]
            missing = [s for s in shards if not (root / s).is_file()]
            if missing:
                return [f"{index} lists {missing[0]}, which is missing ({len(missing)} of {len(shards)} shards)"]
            files = [root / s for s in shards]
            break
    else:
        files = sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))
        if not files:
            return [f"{root}: no model weights (*.safetensors or pytorch_model*.bin) next to its config.json"]
    p = [(_safetensors_problem(f) if f.suffix == ".safetensors" else _bin_problem(f)) for f in files]
    return [x for x in p if x]


def _utf8_problem(path: Path) -> str | None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                at = offset - pending + exc.start
                return f"{path}: not UTF-8 text at byte offset {at} ({exc.reason}); re-encode it as UTF-8"
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"{path}: not UTF-8 text: it ends inside a character (byte offset {offset})"
    return None


def data_file_problems(dataset: str | None) -> list[str]:
    """UTF-8 problems of a local text data file, or of the text files of a local data dir."""
    if not dataset:
        return []
    root = Path(dataset)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    p = [_utf8_problem(f) for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    return [x for x in p if x]
