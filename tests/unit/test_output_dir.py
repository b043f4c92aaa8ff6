"""The output dir is hfpar's only where hfpar wrote it; untrusted model files and lost data are said in one line.

    python -m pytest -q tests/unit/test_output_dir.py

Multi-process and whole-run cases (two runs into one dir, a refusal on rank 1 only, custom code under a terminal):
tests/launch/test_output_dir.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfpar import data
from hfpar.checkpoint.checkpointer import apply_retention, save_checkpoint
from hfpar.checkpoint.layout import MARKER, is_hfpar_checkpoint
from hfpar.checkpoint.manifest import write_manifest
from hfpar.checkpoint.output_dir import (
    LOCK_FILE,
    OutputDirLock,
    foreign_entries,
    held_by_another_launch,
)
from hfpar.checkpoint.ownership import record_written
from hfpar.config import ConfigError
from hfpar.data.dropped import MAX_LOST_FRACTION, announce_data_loss, data_loss_lines
from hfpar.loading import sources
from hfpar.observe import refusal


def _hfpar_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    write_manifest(path)
    (path / MARKER).write_text("1")
    return path


# ------------------------------------------------------------------------------------------------- the lock
def test_a_second_lock_is_refused_naming_the_holder_and_released_on_exit(tmp_path):
    out = tmp_path / "run"
    first = OutputDirLock(out)
    assert first.acquire() is None and (out / LOCK_FILE).is_file()
    with pytest.raises(
        ConfigError,
        match=rf"is in use by another run \(pid {os.getpid()} on .*started .*wait for it "
        "to finish, or pick another --output_dir",
    ):
        OutputDirLock(out).acquire()  # flock is per open file: refused even in the same process
    first.release()
    assert not out.exists()  # created by the lock, left empty: removed with it
    again = OutputDirLock(out)
    assert again.acquire() is None
    again.release()


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_said(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 999999999, "started": "yesterday"}))
    lock = OutputDirLock(tmp_path)
    note = lock.acquire()
    assert note and "took over a stale lock of pid 999999999 on h, started yesterday" in note and "\n" not in note
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert tmp_path.is_dir() and not (tmp_path / LOCK_FILE).exists()


def test_other_ranks_see_another_launchs_live_lock(tmp_path):
    host = os.uname().nodename
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": host, "pid": os.getpid(), "launch": "other"}))
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # that launch's main process holds it
    try:
        assert held_by_another_launch(tmp_path)["launch"] == "other"
    finally:
        os.close(fd)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": host, "pid": 999999999, "launch": "other"}))
    assert held_by_another_launch(tmp_path) is None  # dead: the main process takes it over


def test_a_stale_lock_whose_pid_lives_on_is_decided_alike_by_every_rank(tmp_path):
    """A killed run's lock whose pid now belongs to another live process (pid 1 here), no flock on it: stale for the
    other ranks too (they asked the pid only, and refused while rank 0 took it over)."""
    stale = {"host": os.uname().nodename, "pid": 1, "started": "2026-11-01T00:00:00Z", "launch": "10.9.9.9:1234:"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    assert held_by_another_launch(tmp_path) is None
    lock = OutputDirLock(tmp_path)
    assert "took over a stale lock of pid 1" in lock.acquire()
    lock.release()


# ---------------------------------------------------------------------------------------------- ownership
def test_only_what_hfpar_wrote_is_its_own(tmp_path):
    _hfpar_checkpoint(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "notes.txt").write_text("mine")
    (tmp_path / "checkpoint-6").write_text("a file")
    (tmp_path / "checkpoint-7").symlink_to(tmp_path / "checkpoint-2")
    (tmp_path / "metrics.jsonl").mkdir()
    assert foreign_entries(tmp_path) == [
        ("checkpoint-5", "a directory without hfpar's COMPLETE marker and MANIFEST.json"),
        ("checkpoint-6", "a file"),
        ("checkpoint-7", "a symlink"),
        ("metrics.jsonl", "not a file"),
    ]
    assert is_hfpar_checkpoint(tmp_path / "checkpoint-2") and not is_hfpar_checkpoint(tmp_path / "checkpoint-7")


def test_retention_never_deletes_a_folder_hfpar_did_not_write(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / MARKER).write_text("someone's")  # a marker, but no manifest: not hfpar's
    for step in (2, 3, 4):
        _hfpar_checkpoint(tmp_path / f"checkpoint-{step}")
    record_written(tmp_path, add=("checkpoint-3", "checkpoint-4"))  # written here; checkpoint-2: copied in by the user
    apply_retention(str(tmp_path), 1)
    assert (tmp_path / "checkpoint-1" / MARKER).is_file() and (tmp_path / "checkpoint-2").is_dir()
    assert not (tmp_path / "checkpoint-3").exists() and (tmp_path / "checkpoint-4").is_dir()


class _OneProcess:
    """What save_checkpoint asks of the Accelerator, for one process."""

    is_main_process = True
    _models: list = []

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path, "model.safetensors").write_bytes(b"weights")


def test_a_user_folder_appearing_during_the_run_is_left_and_the_save_skipped(tmp_path, capsys):
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "notes.txt").write_text("mine")
    save_checkpoint(_OneProcess(), str(tmp_path), 5, {"global_step": 5}, None)
    assert (tmp_path / "checkpoint-5" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "checkpoint-5").iterdir()) == ["notes.txt"]
    assert not (tmp_path / ".checkpoint-5.tmp").exists()
    assert "checkpoint-5 is not a checkpoint hfpar wrote" in capsys.readouterr().err
    (tmp_path / "checkpoint-6").symlink_to(tmp_path / "checkpoint-5")  # never written through
    save_checkpoint(_OneProcess(), str(tmp_path), 6, {"global_step": 6}, None)
    assert sorted(p.name for p in (tmp_path / "checkpoint-5").iterdir()) == ["notes.txt"]
    save_checkpoint(_OneProcess(), str(tmp_path), 7, {"global_step": 7}, None)
    assert is_hfpar_checkpoint(tmp_path / "checkpoint-7")
    save_checkpoint(_OneProcess(), str(tmp_path), 7, {"global_step": 7}, None)  # its own: replaced
    assert is_hfpar_checkpoint(tmp_path / "checkpoint-7")


# ------------------------------------------------------------------------------------------- remote code
def custom_code_model(root: Path) -> Path:
    """The embedded tiny model's files plus auto_map and a configuration file that, if run, leaves a mark."""
    shutil.copytree(data.embedded_model_path(), root)
    cfg = json.loads((root / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilLM"}
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "configuration_evil.py").write_text(
        f"from pathlib import Path\nPath({str(root / 'CODE_RAN')!r}).write_text('yes')\n"  # (transformers runs a copy)
        "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    pass\n"
    )
    (root / "modeling_evil.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_evil import EvilConfig\n"
        "class EvilLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return root


def test_custom_code_is_refused_without_the_flag(tmp_path):
    model = custom_code_model(tmp_path / "m")
    problems = sources.source_problems(str(model), trust_remote_code=False, option="--model_name_or_path")
    assert (
        len(problems) == 1
        and "config.json has auto_map (custom code: configuration_evil.py, modeling_evil.py)" in problems[0]
    )
    assert "--trust_remote_code" in problems[0]
    assert sources.source_problems(str(model), trust_remote_code=True, option="--model_name_or_path") == []
    assert not (model / "CODE_RAN").exists()


def test_untrusted_json_is_bounded_and_one_line(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)
    (d / "tokenizer.json").write_text('{"model": ' + "[" * 5000 + "]" * 5000 + "}")
    lines = sources.source_problems(str(d), trust_remote_code=False, option="--model_name_or_path")
    assert len(lines) == 2 and all("nested deeper than 64 levels" in x for x in lines), lines
    (d / "config.json").write_text('{"model_type": ')
    (d / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(sources, "MAX_TOKENIZER_BYTES", 1)
    lines = sources.source_problems(str(d), trust_remote_code=False, option="--model_name_or_path")
    assert "config.json: not valid JSON" in lines[0] and "tokenizer.json has 2 bytes, over the 1" in lines[1]


def test_a_deeply_nested_tokenizer_fails_in_one_line(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(data.embedded_model_path(), tok)
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(data.DataError) as e:
        data.load_tokenizer(str(tok))
    assert "could not be loaded" in str(e.value) and "\n" not in str(e.value)


def test_a_deeply_nested_data_file_fails_in_one_line(tmp_path):
    for name in ("deep.jsonl", "deep.json"):
        (tmp_path / name).write_text('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
        with pytest.raises(data.DataError, match="nested too deeply"):
            data.load_splits(str(tmp_path / name), "sft")


def test_export_refuses_custom_code_and_a_non_empty_destination(tmp_path, capsys):
    from hfpar.cli import main as cli

    model = custom_code_model(tmp_path / "run" / "checkpoint-1")
    for argv, expected in (
        ([model, tmp_path / "out"], "config.json has auto_map"),
        ([model, tmp_path / "run"], "is not empty (checkpoint-1): pass --overwrite"),
    ):
        with pytest.raises(SystemExit) as e:
            cli(["export", *map(str, argv)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists() and not (model / "CODE_RAN").exists()


# ------------------------------------------------------------------------------------------ data loss
def long_prompts(path: Path, lost: int, kept: int) -> Path:
    """SFT prompt/completion rows: `lost` whose prompt alone fills --max_seq_length 128 (the reply is cut away)."""
    n = lost + kept  # the kept ones spread evenly (whatever the train / eval split takes, each gets its share)
    rows = [
        {"prompt": "hi", "completion": "hello there"}
        if i * kept // n != (i + 1) * kept // n
        else {"prompt": "tell me " * 40, "completion": "ok"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_examples_lost_to_truncation_are_said_and_most_refused():
    args = SimpleNamespace(
        max_seq_length=128, truncation="truncate", per_device_train_batch_size=16, gradient_accumulation_steps=2
    )
    notes, problems = data_loss_lines(
        {"train_data": {"examples": 285, "no_targets": 146, "cut_away": 145, "truncated": 165}}, args
    )
    assert problems == [] and notes == [
        "train data: 146 of 285 examples left out (145 with every target token past --max_seq_length 128; 1 with no "
        "target token at all), 20 of 285 cut to --max_seq_length 128 (raise --max_seq_length or shorten the prompts "
        "to keep them)"
    ]
    lost = int(285 * MAX_LOST_FRACTION) + 1
    notes, problems = data_loss_lines(
        {"train_data": {"examples": 285, "no_targets": lost}, "eval_data": {"examples": 10, "truncated": 0}}, args
    )
    assert notes == [] and len(problems) == 1 and "more than 90% of the examples would be left out" in problems[0]
    assert data_loss_lines({"train_data": {"pairs": 8, "truncated": 2}}, args)[0] == [
        "train data: 2 of 8 pairs cut to --max_length"
    ]
    with pytest.raises(
        data.DataError,
        match=r"^the training set has 63 rows, fewer than one global batch of 64 "
        r"\(--per_device_train_batch_size 16 x dp 2 x --gradient_accumulation_steps 2\)",
    ):
        announce_data_loss({}, args, train_rows=63, dp=2)  # (the sampler's limit, before the model loads)


# ------------------------------------------------------------------------------------------- refusals
def test_a_line_said_by_several_ranks_is_printed_once(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(refusal.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29999")
    refusal.say("--tp_size 3 does not divide 2")
    refusal.say("--tp_size 3 does not divide 2\nanother problem")  # another rank: the same line, and its own
    assert capsys.readouterr().err.splitlines() == [
        "hfpar: error: --tp_size 3 does not divide 2",
        "hfpar: error: another problem",
    ]
    assert refusal.peer_refused()


def test_hfpar_help_exits_0(capsys):
    from hfpar.cli import main as cli

    cli(["--help"])
    assert "hfpar launch" in capsys.readouterr().out


def test_only_the_verified_fsdp2_view_warnings_are_silenced():
    """The logits FSDP2 returns as views (lm_head with the final norm, the CausalLM root): silenced (hfpar's loss
    reads them out of place; the FSDP2 parity tests equal one process); a view from any other module still warns."""
    import warnings

    import hfpar.backends.wraps  # (installs the filter)

    def shown(cls: str) -> bool:
        with warnings.catch_warnings(record=True) as seen:
            warnings.filterwarnings("default")  # as a user's process: then the module's filter, re-installed
            warnings.filterwarnings("ignore", category=UserWarning, message=hfpar.backends.wraps.VIEW_WARNING)
            warnings.warn(f"FSDP2-wrapped module ({cls}) returned a view tensor. An in-place op ...", UserWarning)
        return bool(seen)

    assert not shown("FSDPLlamaRMSNorm, FSDPLinear") and not shown("FSDPLlamaForCausalLM")
    assert not shown("FSDPQwen3ForSequenceClassification")
    assert shown("FSDPLlamaDecoderLayer") and shown("FSDPLlamaAttention")


def test_the_flag_lets_the_custom_code_run(tmp_path, capsys, monkeypatch):
    """--trust_remote_code: the user asked, transformers imports the directory's code (here: hfpar plan)."""
    from hfpar.cli import main as cli

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = custom_code_model(tmp_path / "m")
    cli(["plan", "--model", str(model), "--num_gpus", "2", "--gpu_memory_gb", "80", "--trust_remote_code"])
    assert (model / "CODE_RAN").read_text() == "yes" and "ddp" in capsys.readouterr().out.lower()
