"""Pickle payloads planted in a checkpoint's files, and the readers that must refuse them.

    assert_no_planted_payload_runs(ckpt_dir, tmp_path)   # every file of a real checkpoint, one at a time

A payload is a pickle whose unpickling creates a marker file (it runs `exec`). Each file of the checkpoint is replaced
by one (a torch.save zip for *.pt / *.bin, a raw pickle otherwise), the manifest re-signed as an attacker with write
access would, and the file read the way its library reads it, inside hfpar's safe_loading(): Accelerate and DeepSpeed
call torch.load(weights_only=False), DCP reads `.metadata` with pickle.load, hfpar reads its RNG with safetensors and
its state as JSON. Every read must fail with a clear error and the marker must never appear.

    assert_reads_in_both_pickle_forms(ckpt_dir, tmp_path)  # every pickle of a real checkpoint re-written with its
                                                           # enum members as getattr(cls, name): still read (#37)
"""

from __future__ import annotations

import builtins
import enum
import io
import json
import pickle
import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from hfpar.checkpoint.export import ExportError, export_checkpoint
from hfpar.checkpoint.manifest import MANIFEST, write_manifest
from hfpar.checkpoint.rank_state import load_rng
from hfpar.checkpoint.safe_load import CheckpointError, safe_loading


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').close()",)


class EnumByName(pickle.Pickler):
    """Pickles every enum member as getattr(<class>, '<name>') (Python's enum.pickle_by_enum_name): the form the
    checkpoints written under PyPI's CUDA build of torch hold, produced here whatever build runs the test."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return enum.pickle_by_enum_name(obj, 2)  # (getattr, (cls, name)) at any protocol
        return NotImplemented


BY_NAME = types.SimpleNamespace(
    Pickler=EnumByName, Unpickler=pickle.Unpickler, load=pickle.load, dump=pickle.dump, __name__="pickle"
)


def _rewrite_by_name(path: Path) -> bool:
    """Re-writes one file of our own (trusted) checkpoint with enum members pickled by name; True where its pickle
    changed (it held an enum)."""
    before = path.read_bytes()
    if path.name == ".metadata":
        buf = io.BytesIO()
        EnumByName(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(pickle.loads(before))
        path.write_bytes(buf.getvalue())
    else:
        torch.save(torch.load(path, map_location="cpu", weights_only=False), path, pickle_module=BY_NAME)
    return b"getattr" in path.read_bytes() and b"getattr" not in before


def assert_reads_in_both_pickle_forms(ckpt: Path, tmp_path: Path) -> int:
    """Every pickle file of `ckpt` (DCP .metadata, torch.save zips) re-written in the by-name enum form, in a copy,
    then read the way its library reads it inside safe_loading(): no refusal. Returns how many files held an enum."""
    copy = tmp_path / f"{ckpt.name}_by_name"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ckpt, copy)
    changed = 0
    for f in files_read(copy):
        if f.name == ".metadata" or f.suffix in (".pt", ".bin"):
            changed += _rewrite_by_name(f)
            with safe_loading(copy):
                read_as_its_library_does(f)
    shutil.rmtree(copy, ignore_errors=True)
    return changed


def plant(path: Path, marker: Path) -> None:
    if path.suffix in (".pt", ".bin"):
        torch.save({"state": Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"state": Payload(marker)}))


def read_as_its_library_does(path: Path, rank: int = 0) -> None:
    name = path.name
    if name == ".metadata":
        FileSystemReader(str(path.parent)).read_metadata()
    elif name.startswith("rng_state_"):
        load_rng(path.parent, int(name.split("_")[2].split(".")[0]))
    elif path.suffix == ".safetensors":
        load_file(str(path))
    elif path.suffix == ".json":
        json.loads(path.read_text())
    elif name == "latest":
        path.read_text()
    else:  # .pt .bin .pkl .distcp: Accelerate, DeepSpeed and zero_to_fp32 pass weights_only=False
        torch.load(path, map_location="cpu", weights_only=False)


def files_read(ckpt: Path) -> list[Path]:
    """Every file a resume or an export could read (not DeepSpeed's helper scripts, never executed)."""
    return sorted(
        p for p in ckpt.rglob("*") if p.is_file() and p.suffix != ".py" and p.name not in ("COMPLETE", MANIFEST)
    )


PICKLE_CAPABLE = (".pt", ".bin", ".pkl", ".distcp")


def assert_no_planted_payload_runs(ckpt: Path, tmp_path: Path, export: bool = False) -> int:
    """Plants a payload in each file of `ckpt` in turn (in a copy); returns how many files were tried. export: also
    `hfpar export` of the copy for each model-state file a pickle could hide in (refused in one line, the payload
    never run; export never reads the optimizer's)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    marker = tmp_path / "PAYLOAD_RAN"
    live = tmp_path / "live.pkl"  # the payload is live: plain pickle runs it
    plant(live, marker)
    pickle.loads(live.read_bytes())
    assert marker.exists()
    marker.unlink()
    copy = tmp_path / ckpt.name
    files = files_read(ckpt)
    assert files, ckpt
    for f in files:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        target = copy / f.relative_to(ckpt)
        plant(target, marker)
        write_manifest(copy)  # re-signed: the manifest alone is not the defence
        with safe_loading(), pytest.raises(Exception) as err:  # noqa: PT011  (each reader has its own error type)
            read_as_its_library_does(target)
        if target.suffix in PICKLE_CAPABLE or target.name == ".metadata":
            assert err.type is CheckpointError and str(target) in str(err.value), err.value
            if export and "model" in str(target.relative_to(copy)):  # what export reads: refused in one line
                with pytest.raises(ExportError) as exc:
                    export_checkpoint(copy, tmp_path / "export")
                assert "\n" not in str(exc.value) and target.name in str(exc.value) or "shard refused" in str(exc.value)
        assert not marker.exists(), f"the payload planted in {f.name} ran"
    shutil.rmtree(copy, ignore_errors=True)
    return len(files)
