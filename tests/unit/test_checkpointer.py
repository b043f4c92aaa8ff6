"""The Checkpointer and the RunRecorder's metrics.jsonl, on one process with stand-ins for the accelerator and backend.

    python -m pytest -q tests/unit/test_checkpointer.py

Cadence (should_save), retention (--save_total_limit, never the last verified checkpoint), `latest` resolution
(complete checkpoints that verify against their manifest, inside the output dir), damaged checkpoints skipped with a
warning, the trainer state / scheduler / RNG written, read back and returned by resume, and metrics.jsonl cut back
to the resumed step. No launch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hfpar.checkpoint.checkpointer import Checkpointer
from hfpar.checkpoint.layout import list_checkpoints, read_trainer_state, resolve_resume
from hfpar.checkpoint.manifest import write_manifest
from hfpar.config import ConfigError
from hfpar.observe.metrics import MetricsWriter
from hfpar.observe.recorder import truncate_metrics

CTX = SimpleNamespace(world=4, dp=2, tp=2, ep=1, cp=1, pp=1, rank=0)


class FakeAccelerator:
    """One process: save_state / load_state write and read a file, so the layout and the calls can be checked."""

    is_main_process = True
    process_index = 0
    _models: list = []

    def __init__(self):
        self.calls, self.registered = [], []
        self.step = 0

    def wait_for_everyone(self):
        pass

    def print(self, *args):
        self.calls.append(("print", " ".join(map(str, args))))

    def register_for_checkpointing(self, obj):
        self.registered.append(obj)

    def save_state(self, path):
        self.calls.append(("save_state", path))
        (Path(path) / "model.safetensors").write_text("weights")

    def load_state(self, path):
        self.calls.append(("load_state", path))


class FakeBackend:
    strategy = "ddp"

    def __init__(self):
        self.calls = []

    def save_rank_state(self, ckpt_dir):
        self.calls.append(("save_rank_state", ckpt_dir.name))
        (ckpt_dir / "rank000_of004.pt").write_text("shard")

    def load_rank_state(self, ckpt_dir):
        self.calls.append(("load_rank_state", ckpt_dir.name))

    def writes_full_state(self):
        return False

    def unwrapped(self):  # a model hfpar wraps itself (no Accelerate model): its config.json, when it has one
        return torch.nn.Identity()

    def resume_mode(self, state, chunks):  # noqa: ARG002  (the same mesh: hfpar.backends.reshard decides otherwise)
        return "native"


def checkpointer(tmp_path, acc=None, backend=None, **kw) -> Checkpointer:
    opts = dict(
        total_steps=10, save_steps=4, save_total_limit=None, resume=None, seed=7, global_batch=16, pp_virtual_stages=1
    )
    opts.update(kw)
    return Checkpointer(acc or FakeAccelerator(), CTX, backend or FakeBackend(), str(tmp_path), **opts)


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text(f"weights {step}")
    write_manifest(d)
    if complete:
        (d / "COMPLETE").write_text(str(step))
    return d


class FakeScheduler:
    def __init__(self):
        self.state = {"last_epoch": 0, "base_lrs": [0.1]}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = state


def test_cadence_every_save_steps_and_the_last_step(tmp_path):
    ck = checkpointer(tmp_path, total_steps=10, save_steps=4)
    assert [s for s in range(1, 11) if ck.should_save(s)] == [4, 8, 10]
    assert not any(checkpointer(tmp_path, save_steps=0).should_save(s) for s in range(1, 11))


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    assert resolve_resume("latest", str(tmp_path)) is None  # fresh run
    assert resolve_resume(None, str(tmp_path)) is None
    for step in (2, 10, 4):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 12, complete=False)  # a killed save
    (tmp_path / "checkpoint-x").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-10"]
    assert resolve_resume("latest", str(tmp_path)).name == "checkpoint-10"
    assert resolve_resume(str(tmp_path / "checkpoint-4"), str(tmp_path)).name == "checkpoint-4"
    with pytest.raises(ConfigError, match="incomplete"):
        resolve_resume(str(tmp_path / "checkpoint-12"), str(tmp_path))
    with pytest.raises(ConfigError, match="no such directory"):
        resolve_resume(str(tmp_path / "checkpoint-99"), str(tmp_path))


def test_save_writes_the_layout_and_retention_keeps_the_newest(tmp_path):
    acc, backend = FakeAccelerator(), FakeBackend()
    ck = checkpointer(tmp_path, acc, backend, save_total_limit=2)
    for step in (4, 8, 10):
        path = ck.save(step)
    assert path == tmp_path / "checkpoint-10"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "MANIFEST.json",
        "model.safetensors",
        "rank000_of004.pt",
        "rng_state_0.safetensors",
        "trainer_state.json",
    ]
    assert (path / "COMPLETE").read_text() == "10"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-8", "checkpoint-10"]
    assert not list(tmp_path.glob(".checkpoint-*"))  # no staging directory left behind
    assert [c for c, _ in backend.calls] == ["save_rank_state"] * 3


def test_trainer_state_round_trip_through_resume(tmp_path):
    backend = FakeBackend()
    ck = checkpointer(tmp_path, backend=backend, pp_virtual_stages=2)
    ck.save(8)
    state = read_trainer_state(tmp_path / "checkpoint-8")
    assert state == {
        "global_step": 8,
        "world_size": 4,
        "dp": 2,
        "tp": 2,
        "ep": 1,
        "cp": 1,
        "pp": 1,
        "pp_virtual_stages": 2,
        "strategy": "ddp",
        "seed": 7,
        "global_batch": 16,
        "peft": False,
        "reshardable": False,
    }
    assert list(state) == list(ck.trainer_state(8))  # key order: the file's bytes
    acc = FakeAccelerator()
    resumed = checkpointer(tmp_path, acc, backend, resume="latest")
    assert resumed.resume() == 8
    assert ("load_state", str(tmp_path / "checkpoint-8")) in acc.calls
    assert backend.calls[-1] == ("load_rank_state", "checkpoint-8")
    assert checkpointer(tmp_path / "fresh", resume="latest").resume() == 0


def test_scheduler_and_rng_round_trip_without_pickle(tmp_path):
    """The scheduler goes to scheduler.json (not Accelerate's pickled custom_checkpoint_0.pkl), each rank's RNG to a
    safetensors file; resume restores both exactly."""
    acc, sched = FakeAccelerator(), FakeScheduler()
    ck = checkpointer(tmp_path, acc)
    ck.register(sched)
    sched.state = {"last_epoch": 4, "base_lrs": [0.1]}
    acc.step = 8
    random.seed(3)
    torch.manual_seed(3)
    ck.save(4)
    expected = (random.random(), torch.rand(3), np.random.rand())
    assert (
        acc.registered == []
        and json.loads((tmp_path / "checkpoint-4" / "scheduler.json").read_text())["last_epoch"] == 4
    )
    acc2, sched2 = FakeAccelerator(), FakeScheduler()
    ck2 = checkpointer(tmp_path, acc2, resume="latest")
    ck2.register(sched2)
    random.seed(0)
    torch.manual_seed(0)
    assert ck2.resume() == 4
    assert sched2.state["last_epoch"] == 4 and acc2.step == 8
    got = (random.random(), torch.rand(3), np.random.rand())
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: max(0, path.stat().st_size // 2)])
    elif how == "delete":
        path.unlink()
    else:  # same size, other bytes
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name", ["model.safetensors", "rank000_of004.pt", "trainer_state.json", "rng_state_0.safetensors"]
)
@pytest.mark.parametrize("how", ["truncate", "delete", "flip"])
def test_a_damaged_checkpoint_is_never_resumed(tmp_path, name, how):
    """Weights / per-rank optimizer / trainer state / RNG file truncated, deleted or altered: `latest` falls back to
    the previous checkpoint; with none left that verifies, one line naming the file."""
    ck = checkpointer(tmp_path, save_total_limit=2)
    ck.save(4)
    ck.save(8)
    _damage(tmp_path / "checkpoint-8" / name, how)
    assert resolve_resume("latest", str(tmp_path)).name == "checkpoint-4"
    _damage(tmp_path / "checkpoint-4" / name, how)
    with pytest.raises(ConfigError, match=r"none of the 2 checkpoint\(s\).*checkpoint-8/" + name):
        resolve_resume("latest", str(tmp_path))


def test_latest_skips_a_damaged_checkpoint_with_a_warning_and_resumes_the_previous(tmp_path, capsys):
    acc, backend = FakeAccelerator(), FakeBackend()
    ck = checkpointer(tmp_path, acc, backend, save_total_limit=3)
    ck.save(4)
    ck.save(8)
    _damage(tmp_path / "checkpoint-8" / "rank000_of004.pt", "truncate")
    ck.save(10)
    (tmp_path / "checkpoint-10" / "rng_state_0.safetensors").unlink()
    capsys.readouterr()
    assert checkpointer(tmp_path, FakeAccelerator(), FakeBackend(), resume="latest").resume() == 4
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0].startswith("hfpar: warning: skipping checkpoint-10: ") and "rng_state_0.safetensors: missing" in err[0]
    )
    assert (
        err[1].startswith("hfpar: warning: skipping checkpoint-8: ")
        and "rank000_of004.pt: 2 bytes, the manifest says 5" in err[1]
    )
    with pytest.raises(ConfigError, match="checkpoint-10/rng_state_0.safetensors: missing"):
        resolve_resume(str(tmp_path / "checkpoint-10"), str(tmp_path))  # a damaged PATH is refused, not skipped
    # retention with limit 1 keeps the last verified checkpoint-4 and the newest
    from hfpar.checkpoint.checkpointer import apply_retention

    apply_retention(str(tmp_path), 1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-10"]


def test_latest_never_follows_a_symlink_out_of_the_output_dir(tmp_path, capsys):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    fake_checkpoint(out, 2)
    target = fake_checkpoint(elsewhere, 9)
    (out / "checkpoint-9").symlink_to(target, target_is_directory=True)
    assert resolve_resume("latest", str(out)).name == "checkpoint-2"
    assert "checkpoint-9 points outside --output_dir" in capsys.readouterr().err
    assert resolve_resume(str(out / "checkpoint-9"), str(out)) == out / "checkpoint-9"  # explicit: allowed
    (out / "checkpoint-2" / "extra.pt").symlink_to(target / "model.safetensors")
    with pytest.raises(ConfigError, match="symlink inside a checkpoint"):
        resolve_resume(str(out / "checkpoint-2"), str(out))


def test_metrics_cut_back_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, enabled=True, append=False)
    for step in range(1, 7):
        writer.write({"step": step, "loss": 1.0 / step})
    writer.write({"step": 4, "eval_loss": 0.5})
    truncate_metrics(path, 4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4]
    truncate_metrics(tmp_path / "absent.jsonl", 4)  # a fresh output dir: nothing to cut
    assert not (tmp_path / "absent.jsonl").exists()


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), "torch"])
def test_a_full_disk_is_reported_as_such_and_leaves_no_staging_dir(tmp_path, monkeypatch, error):
    """ENOSPC from a Python write, or torch.save's C++ 'basic_ios::clear: iostream error' on a disk that is full."""
    from hfpar.checkpoint import write as ck_mod  # where a checkpoint is written: its disk check, DiskFullError

    class FullDiskAccelerator(FakeAccelerator):
        def save_state(self, path):
            (Path(path) / "model.safetensors").write_text("partial")
            if error == "torch":
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0 "
                    "basic_ios::clear: iostream error"
                )
            raise error

    if error == "torch":
        monkeypatch.setattr(ck_mod.shutil, "disk_usage", lambda p: SimpleNamespace(free=1024, total=1, used=1))
    ck = checkpointer(tmp_path)
    ck.save(4)
    ck.acc = FullDiskAccelerator()
    with pytest.raises(
        ck_mod.DiskFullError, match=r"disk full while saving checkpoint-8 .*earlier checkpoints are intact"
    ):
        ck.save(8)
    assert not list(tmp_path.glob(".checkpoint-*")) and [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4"]


def test_dcp_metadata_reader_resolves_dcp_classes_only(tmp_path):
    """FSDP2's `.metadata` is a pickle DCP reads with pickle.load: hfpar's reader resolves DCP's own metadata classes
    and torch values, and refuses anything else (here builtins.exec, and a class DCP's module merely imports)."""
    import pickle

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from hfpar.checkpoint.safe_load import CheckpointError, MetadataUnpickler, check_dcp_metadata

    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([2, 3]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))],
            )
        }
    )
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(meta))
    check_dcp_metadata(tmp_path / "ok")
    with open(tmp_path / "ok" / ".metadata", "rb") as fh:
        assert MetadataUnpickler(fh).load().state_dict_metadata["w"].size == torch.Size([2, 3])
    for bad in (b'cbuiltins\nexec\n(S\'open("x", "w")\'\ntR.', b"ctorch.distributed.checkpoint.metadata\nEnum\n."):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / ".metadata").write_bytes(bad)
        with pytest.raises(CheckpointError, match=r"\.metadata: refused to read it \(global .* is not allowed"):
            check_dcp_metadata(tmp_path / "bad")
    assert not (tmp_path / "x").exists() and not Path("x").exists()
