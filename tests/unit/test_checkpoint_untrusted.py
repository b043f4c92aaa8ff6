"""A checkpoint's own files are untrusted: each one that is not hfpar's shape is one line naming it, before the model
loads (the checkpoint preflight) and in `hfpar export`; nothing is read from outside the checkpoint.

    python -m pytest -q tests/unit/test_checkpoint_untrusted.py

The audit's repros exp_D (planted pickle), exp_E (a link out, no manifest), exp_F (RNG file), exp_I (another model),
exp_M (DeepSpeed `latest` out), exp_P (trainer_state.json) as unit cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from hfpar import data
from hfpar.checkpoint import manifest
from hfpar.checkpoint.export import ExportError, export_checkpoint
from hfpar.checkpoint.layout import RESUME_KEYS, deepspeed_tag, read_trainer_state
from hfpar.checkpoint.rank_state import load_rng, save_rng
from hfpar.checkpoint.resume_checks import checkpoint_problems
from hfpar.config import ConfigError

ARGS = SimpleNamespace(model_name_or_path="base", upcycle_experts=0)


def _ckpt(root: Path) -> Path:
    ckpt = root / "checkpoint-1"
    ckpt.mkdir(parents=True)
    save_rng(ckpt, 0, 3)
    return ckpt


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[]", "holds a JSON list, hfpar's trainer state is an object"),
        ('{"global_step": 1}', "'global_batch' must be an integer >= 1 (no such key)"),
        ("not json", "not valid JSON"),
    ],
)
def test_a_malformed_trainer_state_is_one_line_naming_it(tmp_path, text, expected):
    (tmp_path / "trainer_state.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        read_trainer_state(tmp_path, RESUME_KEYS)
    assert str(e.value).startswith(str(tmp_path / "trainer_state.json")) and expected in str(e.value)
    assert "\n" not in str(e.value)


def test_a_planted_pickle_is_refused_unread(tmp_path):
    ckpt = _ckpt(tmp_path)
    (ckpt / "custom_checkpoint_0.pkl").write_bytes(b"\x80\x04not even read")
    (problem,) = checkpoint_problems(ckpt, ARGS, None)
    assert "custom_checkpoint_0.pkl: pickle files hfpar never writes" in problem


def test_an_rng_file_without_hfpars_state_stops_every_rank_with_one_line(tmp_path):
    ckpt = _ckpt(tmp_path)
    save_file({"nothing": torch.zeros(1)}, str(ckpt / "rng_state_1.safetensors"))  # exp_F: no metadata at all
    save_file({"nothing": torch.zeros(1)}, str(ckpt / "rng_state_2.safetensors"), metadata={"state": "{}"})
    problems = checkpoint_problems(ckpt, ARGS, None)  # every rank checks every rank's file
    assert len(problems) == 2 and "rng_state_1.safetensors: no generator state in its metadata" in problems[0]
    assert "rng_state_2.safetensors: missing or invalid state 'python_version'" in problems[1]
    with pytest.raises(ValueError, match="no generator state"):  # (was a TypeError traceback on that rank)
        load_rng(ckpt, 1)
    assert load_rng(ckpt, 0) == 3


def test_a_checkpoint_of_another_model_is_refused_before_loading(tmp_path):
    ckpt = _ckpt(tmp_path)
    config = AutoConfig.from_pretrained(data.embedded_model_path())
    config.save_pretrained(ckpt)
    assert checkpoint_problems(ckpt, ARGS, config) == []
    mine = AutoConfig.from_pretrained(data.embedded_model_path(), num_hidden_layers=1)
    (problem,) = checkpoint_problems(ckpt, ARGS, mine)
    assert f"is of another model (num_hidden_layers {config.num_hidden_layers}" in problem
    assert "--model_name_or_path base has num_hidden_layers 1" in problem


def test_deepspeed_latest_names_a_plain_folder_inside_the_checkpoint(tmp_path):
    ckpt = _ckpt(tmp_path / "run")
    (tmp_path / "zero_outside" / "pytorch_model").mkdir(parents=True)
    (ckpt / "pytorch_model").mkdir()
    for tag in ("../zero_outside/pytorch_model", "/abs", "..", "missing"):
        (ckpt / "latest").write_text(tag)
        with pytest.raises(ConfigError):
            deepspeed_tag(ckpt)
        assert checkpoint_problems(ckpt, ARGS, None) and "\n" not in checkpoint_problems(ckpt, ARGS, None)[0]
    (ckpt / "latest").write_text("pytorch_model")
    assert deepspeed_tag(ckpt) == ckpt / "pytorch_model"
    (ckpt / "latest").write_text("../zero_outside/pytorch_model")  # exp_M: `hfpar export` read the states outside
    with pytest.raises(ExportError, match="valid is a plain folder name inside"):
        export_checkpoint(ckpt, tmp_path / "exported")


def test_export_follows_no_link_manifest_or_not(tmp_path):
    """exp_E: no MANIFEST.json / COMPLETE, model.safetensors a link out of the checkpoint: exported before."""
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "secret.safetensors"))
    (ckpt / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    AutoConfig.from_pretrained(data.embedded_model_path()).save_pretrained(ckpt)
    with pytest.raises(ExportError, match="a symlink inside a checkpoint, refused|outside the directory you named"):
        export_checkpoint(ckpt, tmp_path / "exported")
    (ckpt / "model.safetensors").unlink()  # a link that stays inside: refused too (no manifest to vouch for it)
    (ckpt / "w").mkdir()
    (tmp_path / "secret.safetensors").rename(ckpt / "w" / "real.safetensors")
    (ckpt / "model.safetensors").symlink_to("w/real.safetensors")
    with pytest.raises(ExportError, match="model.safetensors: a symlink inside a checkpoint, refused"):
        export_checkpoint(ckpt, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("entry", ["../outside.bin", "/etc/hostname", "a/../../outside.bin", "./x"])
def test_a_manifest_entry_outside_the_checkpoint_is_refused_unhashed(tmp_path, monkeypatch, entry):
    ckpt = _ckpt(tmp_path)
    (tmp_path / "outside.bin").write_text("elsewhere")
    manifest.write_manifest(ckpt)
    m = json.loads((ckpt / manifest.MANIFEST).read_text())
    m["files"][entry] = {"size": 9, "sha256": "0" * 64}
    (ckpt / manifest.MANIFEST).write_text(json.dumps(m))
    hashed = []
    monkeypatch.setattr(manifest, "file_hash", lambda p: hashed.append(p) or "")
    problem = manifest.verify(ckpt)
    assert problem and "not hfpar's manifest" in problem and not hashed
