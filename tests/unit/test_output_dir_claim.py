"""Claiming an --output_dir: what hfpar did not write there is refused in one line, never written through, moved or
deleted (with --overwrite_output_dir too, for links, a user's checkpoint-<step> and staging-named folders).

    python -m pytest -q tests/unit/test_output_dir_claim.py

The audit's repros (exp_B, exp_G, exp_H, exp_H2, exp_L, exp_N) as unit cases; the lock: tests/unit/test_output_dir.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfpar.checkpoint.final_model import publish
from hfpar.checkpoint.layout import MARKER
from hfpar.checkpoint.manifest import write_manifest
from hfpar.checkpoint.output_dir import claim_output_dir, release_output_dir
from hfpar.checkpoint.ownership import LEDGER, REPLACED, STAGING_MARK, owned_names, set_aside
from hfpar.checkpoint.write import save_checkpoint
from hfpar.config import ConfigError
from tests.unit.test_output_dir import _OneProcess


@pytest.fixture(autouse=True)
def _main_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")


def _args(out: Path, **kw) -> SimpleNamespace:
    base = dict(output_dir=str(out), overwrite_output_dir=False, resume_from_checkpoint=None)
    return SimpleNamespace(**{**base, "model_name_or_path": "hfpar-tiny", "tokenizer_path": None, **kw})


def _refused(args) -> str:
    with pytest.raises(ConfigError) as e:
        claim_output_dir(args)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _claim(args) -> None:
    release_output_dir(claim_output_dir(args))


def _hfpar_run(out: Path) -> None:
    """What a finished hfpar run leaves: claimed, records, final model, a checkpoint (listed by its release)."""
    lock = claim_output_dir(_args(out))
    for name in ("metrics.jsonl", "run_info.json", "config.json", "tokenizer.json", "model.safetensors"):
        (out / name).write_text("{}")
    ckpt = out / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    write_manifest(ckpt)
    (ckpt / MARKER).write_text("2")
    release_output_dir(lock)


def test_user_files_links_and_staging_names_are_refused_in_one_line(tmp_path):
    """exp_B / exp_G / exp_N1: nothing of the user's is overwritten, deleted or written through."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (victim / "tok.json").write_text("USER PRECIOUS TOKENIZER")
    (out / "tokenizer.json").symlink_to("../victim/tok.json")
    (out / "model-00001-of-00002.bin").write_text("user's shard")
    (out / "README.md").write_text("# My notes")
    (out / ".checkpoint-1.tmp").mkdir()
    (out / ".checkpoint-1.tmp" / "precious.txt").write_text("user data")
    line = _refused(_args(out))
    for what in (
        ".checkpoint-1.tmp (a directory hfpar did not stage)",
        "README.md (not written by hfpar)",
        "model-00001-of-00002.bin (not written by hfpar)",
        "tokenizer.json (a symlink)",
    ):
        assert what in line, line
    line = _refused(_args(out, overwrite_output_dir=True))  # the flag replaces files, never links nor folders
    assert "tokenizer.json (a symlink)" in line and ".checkpoint-1.tmp" in line and "README.md" not in line
    (out / "tokenizer.json").unlink()
    (out / ".checkpoint-1.tmp" / "precious.txt").rename(out / "precious.txt")
    (out / ".checkpoint-1.tmp").rmdir()
    _claim(_args(out, overwrite_output_dir=True))
    assert set_aside(out) is None  # nothing of hfpar's there: the user's files stay where they are
    assert (out / "README.md").read_text() == "# My notes" and (out / "model-00001-of-00002.bin").is_file()
    assert (victim / "tok.json").read_text() == "USER PRECIOUS TOKENIZER" and not (out / ".hfpar.lock").exists()


def test_hfpars_own_previous_run_is_recognised_and_resumable(tmp_path):
    out = tmp_path / "out"
    _hfpar_run(out)
    assert {"metrics.jsonl", "tokenizer.json", "checkpoint-2"} <= owned_names(out)
    _claim(_args(out, resume_from_checkpoint="latest"))  # resuming its own run: allowed, as before
    (out / "notes.txt").write_text("mine")
    assert "notes.txt (not written by hfpar)" in _refused(_args(out, resume_from_checkpoint="latest"))


def test_overwrite_sets_aside_hfpars_entries_only_and_each_time_into_a_new_dir(tmp_path):
    """exp_N2 (a user's checkpoint-5 is refused, not moved) and the `.replaced/<UTC second>` collision."""
    out = tmp_path / "out"
    _hfpar_run(out)
    (out / "notes.txt").write_text("mine")
    _claim(_args(out, overwrite_output_dir=True))
    first = set_aside(out)
    assert sorted(p.name for p in first.iterdir()) == [
        "checkpoint-2",
        "config.json",
        "metrics.jsonl",
        "model.safetensors",
        "run_info.json",
        "tokenizer.json",
    ]
    assert (out / "notes.txt").is_file()
    (out / "metrics.jsonl").write_text("{}")
    second = set_aside(out)  # the same second: a new directory, the first set-aside intact
    assert second != first and (first / "metrics.jsonl").is_file() and (second / "metrics.jsonl").is_file()
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "notes.txt").write_text("user notes")
    assert "checkpoint-5 (a directory without" in _refused(_args(out, overwrite_output_dir=True))
    assert (out / "checkpoint-5" / "notes.txt").is_file()


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_the_model_directory_is_never_the_output_dir_even_with_overwrite(tmp_path, where):
    """exp_H: --output_dir equal to (inside, holding) the model dir moved its config and weights away."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = {"same": model, "inside": model / "run", "holding": tmp_path}[where]
    line = _refused(_args(out, model_name_or_path=str(model), overwrite_output_dir=True))
    assert "the --model_name_or_path directory" in line and "pick an --output_dir outside it" in line
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]


def test_a_non_utf8_output_dir_is_refused_before_anything_is_written(tmp_path):
    """exp_L: accepted, then a UnicodeEncodeError at the first save, and a relaunch blocked by the leftover."""
    out = tmp_path / os.fsdecode(b"out_\xff")
    assert "is not valid UTF-8" in _refused(_args(out)) and not out.exists()


def test_a_save_never_deletes_a_user_folder_named_like_its_staging_dir(tmp_path, capsys):
    (tmp_path / ".checkpoint-5.tmp").mkdir()
    (tmp_path / ".checkpoint-5.tmp" / "precious.txt").write_text("user data")
    save_checkpoint(_OneProcess(), str(tmp_path), 5, {"global_step": 5}, None)
    assert (tmp_path / ".checkpoint-5.tmp" / "precious.txt").read_text() == "user data"
    assert not (tmp_path / "checkpoint-5").exists() and "not a staging dir hfpar made" in capsys.readouterr().err
    save_checkpoint(_OneProcess(), str(tmp_path), 6, {"global_step": 6}, None)
    assert (tmp_path / "checkpoint-6" / MARKER).is_file() and not (tmp_path / "checkpoint-6" / STAGING_MARK).exists()
    assert "checkpoint-6" in owned_names(tmp_path)


def test_the_final_model_is_renamed_into_place_never_written_through_a_link(tmp_path):
    """exp_B (a tokenizer.json link out of the output dir) and exp_G1 (transformers' shard cleanup)."""
    out, stage = tmp_path / "out", tmp_path / "out" / ".final-model.tmp"
    stage.mkdir(parents=True)
    (tmp_path / "victim.json").write_text("USER")
    (out / "tokenizer.json").symlink_to(tmp_path / "victim.json")
    (out / "model-00001-of-00002.bin").write_text("user's shard")
    (stage / STAGING_MARK).write_text("final")
    (stage / "tokenizer.json").write_text("{}")
    (stage / "model.safetensors").write_text("w")
    publish(stage, out)
    assert (tmp_path / "victim.json").read_text() == "USER" and not (out / "tokenizer.json").is_symlink()
    assert (out / "model-00001-of-00002.bin").is_file() and not stage.exists()
    assert {"tokenizer.json", "model.safetensors"} <= owned_names(out)


def test_a_refused_overwrite_run_moves_nothing(tmp_path, capsys):
    """exp_H2: --overwrite_output_dir with a bad option had already moved the previous run to .replaced/."""
    from hfpar.checkpoint import output_dir
    from hfpar.recipe import main

    out = tmp_path / "out"
    _hfpar_run(out)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(SystemExit) as e:
        main("sft", ["--output_dir", str(out), "--overwrite_output_dir", "true", "--tp_size", "3"])
    assert e.value.code == 2 and "--tp_size 3" in capsys.readouterr().err
    for lock in list(output_dir._HELD.values()):  # (a process's exit releases it)
        release_output_dir(lock)
    assert sorted(p.name for p in out.iterdir()) == before and not (out / REPLACED).exists()
    assert json.loads((out / LEDGER).read_text())["written"]
