"""The checkpoint files behind hfpar.loading.sharded: which file holds each tensor, and reading a box of one tensor.

    index = checkpoint_index("ckpt/")       # {tensor name: file}: *.safetensors (preferred, as from_pretrained)
                                            # or pytorch_model*.bin; None: neither (or a pre-1.6 pickle .bin)
    files = Files(index, keys_needed)
    rows = read(files, "model.layers.0.mlp.down_proj.weight", [(0, 64), (0, 256)])   # only those bytes read

Both formats are read through mmap, so only the touched pages of a file count in the process's RSS:
safetensors' `get_slice`, and for *.bin `torch.load(mmap=True, weights_only=True)` (zip format, the default of
torch.save since 1.6; what transformers' own loader calls), whose tensors are views of the mapped file until a
box of them is copied out. Legacy (non-zip) .bin files cannot be mapped: they load whole with from_pretrained.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from hfpar.loading.contained import bound, index_entry_problem, outside

__all__ = ["checkpoint_index", "Files", "read", "SAFETENSORS_INDEX", "BIN_INDEX"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_BIN = re.compile(r"pytorch_model(-\d+-of-\d+)?\.bin$")


def _inside(path: str, name: str) -> bool:
    """True, or ValueError if `name` of checkpoint dir `path` is absolute, climbs out, or links outside it. The
    run's preflight refused such a local dir in one line (hfpar.loading.contained); this reader refuses it again
    for any caller (a hub snapshot too: its links may reach its repo's blobs, nothing else)."""
    why = index_entry_problem(name) or (
        f"{name!r} resolves outside" if outside(Path(path, name), bound(Path(path))) else None
    )
    if why:
        raise ValueError(f"{path}: {why}; hfpar reads only the files inside a checkpoint directory")
    return True


def _from_index(path: str, name: str) -> dict[str, str]:
    with open(os.path.join(path, name)) as f:
        wmap = json.load(f)["weight_map"]
    for v in set(wmap.values()):
        _inside(path, v)
    return {k: os.path.join(path, v) for k, v in wmap.items()}


def checkpoint_index(path: str | None) -> dict[str, str] | None:
    """{tensor name: file} of a checkpoint directory: a sharded index or the files themselves, safetensors first
    (from_pretrained's preference), else pytorch_model*.bin in torch's zip format; None if it has neither."""
    if path is None or not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        return _from_index(path, SAFETENSORS_INDEX)
    index = {}
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        _inside(path, name)
        with safe_open(os.path.join(path, name), "pt") as f:
            index.update({k: os.path.join(path, name) for k in f.keys()})
    if index:
        return index
    if os.path.isfile(os.path.join(path, BIN_INDEX)):
        index = _from_index(path, BIN_INDEX)
        files = sorted(set(index.values()))
    else:
        files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if _BIN.match(f) and _inside(path, f)]
    if not files or not all(zipfile.is_zipfile(f) for f in files):
        return None  # a legacy pickle cannot be memory-mapped: from_pretrained reads it whole
    for f in files if not index else []:
        index.update(dict.fromkeys(_load_bin(f), f))
    return index


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    """A .bin state dict whose tensors are views of the memory-mapped file (nothing read until touched)."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class _BinSlice:
    """safetensors' get_slice interface over a tensor of a mapped .bin: get_shape(), [box] copies the box out."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, box) -> torch.Tensor:
        return self.tensor[box].clone(memory_format=torch.contiguous_format)  # own storage: the map can go


class Files:
    """Open checkpoint files. A safetensors file is opened for each tensor read and closed after it, a .bin once no
    tensor still to read needs it (torch.load parses the whole pickle per open). Both formats read through mmap,
    and a mapped page that was read counts in the process's RSS until the map closes: per tensor, a rank's peak is
    what it keeps plus one tensor's pages, not also every page it read before."""

    def __init__(self, index: dict[str, str], keys_needed: list[str]):
        self.index = index
        self.left = defaultdict(int)  # .bin: tensors still to read per file
        for k in keys_needed:
            self.left[index[k]] += 1
        self.more = defaultdict(int)  # per key: further reads announced (several boxes of one tensor)
        self.open: dict[str, object] = {}  # safetensors: per key; .bin: per file

    def _handle(self, key: str):
        path = self.index[key]
        slot = path if path.endswith(".bin") else key
        if slot not in self.open:
            self.open[slot] = _load_bin(path) if path.endswith(".bin") else safe_open(path, "pt")
        return self.open[slot]

    def slice(self, key: str):
        handle = self._handle(key)
        return _BinSlice(handle[key]) if isinstance(handle, dict) else handle.get_slice(key)

    def whole(self, key: str) -> torch.Tensor:
        """All of a tensor (0-d ones too, which cannot be sliced)."""
        sl = self.slice(key)
        if sl.get_shape():
            return sl[:]
        handle = self._handle(key)
        return handle[key].clone() if isinstance(handle, dict) else handle.get_tensor(key)

    def expect(self, key: str, reads: int) -> None:
        """`reads` more reads of `key` come before the last one's done() may close its file."""
        self.more[key] += reads

    def done(self, key: str) -> None:
        if self.more.get(key, 0) > 0:
            self.more[key] -= 1
            return
        path = self.index[key]
        if not path.endswith(".bin"):
            self.open.pop(key, None)
            return
        self.left[path] -= 1
        if self.left[path] == 0:
            self.open.pop(path, None)


def read(files: Files, key: str, box: list[tuple[int, int]] | None) -> torch.Tensor:
    """The box [(start, stop) per leading dim] of a checkpoint tensor (None: all of it); only those bytes read."""
    out = files.slice(key)[tuple(slice(a, b) for a, b in box)] if box else files.whole(key)
    files.done(key)
    # owned bytes: safetensors returns a contiguous range as a view of its copy-on-write mmap of the file; a
    # parameter must not hang on the file staying unchanged (a checkpoint overwritten or truncated during the
    # run), and the map must close for the pages read to leave the RSS (.bin boxes are copies already)
    return out if files.index[key].endswith(".bin") else out.clone()
