"""Files a user points hfpar at are untrusted: nothing is read from outside the directory named, no model code runs
without --trust_remote_code (hfpar plan too), and the refusal records' directory is never a way to delete elsewhere.

    python -m pytest -q tests/unit/test_untrusted_paths.py
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PretrainedConfig

from hfpar import data
from hfpar.cli import main as cli
from hfpar.loading import files, sources
from hfpar.observe import refusal
from hfpar.planner.memory import PlannerError, model_stats, untrusted_fields


def _args(model: Path | str, dataset: Path | str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model_name_or_path=str(model),
        tokenizer_name_or_path=None,
        resume_from_checkpoint=None,
        dataset_name=str(dataset) if dataset else None,
        trust_remote_code=False,
    )


def _model_dir(path: Path) -> Path:
    """The embedded tiny Llama's config and tokenizer, with a (placeholder) weights file."""
    shutil.copytree(data.embedded_model_path(), path)
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    return path


def _one_line(problems: list[str], *expected: str) -> None:
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert all(e in problems[0] for e in expected), problems[0]


# ------------------------------------------------------------------------------------------------ planner
def test_plan_runs_no_config_code_without_the_flag(tmp_path, monkeypatch):
    """A hub config with auto_map whose model_type transformers knows: planned with the built-in class, the repo's
    modeling file never imported (it used to be, with trust_remote_code derived from the config itself)."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    repo = tmp_path / "evil"
    repo.mkdir()
    marker = tmp_path / "CODE_RAN"
    (repo / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('yes')\n"
        "from transformers import LlamaForCausalLM\nclass EvilForCausalLM(LlamaForCausalLM):\n    pass\n"
    )
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    )  # fmt: skip
    config._name_or_path = str(repo)  # where transformers fetches the auto_map code from
    stats = model_stats(config)
    assert stats.n_params > 0 and stats.model_type == "llama" and not marker.exists()
    with pytest.raises(PlannerError, match="only with --trust_remote_code"):
        untrusted_fields({"model_type": "evilllama", "auto_map": {"AutoModelForCausalLM": "m.C"}})


def test_plan_refuses_a_hub_model_that_is_only_custom_code(monkeypatch, capsys):
    fields = {"model_type": "evilllama", "auto_map": {"AutoConfig": "c.C", "AutoModelForCausalLM": "m.M"}}
    monkeypatch.setattr(PretrainedConfig, "get_config_dict", classmethod(lambda cls, name, **kw: (fields, {})))
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--model", "evil/tiny", "--num_gpus", "2", "--gpu_memory_gb", "80"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("hfpar: error: --model evil/tiny: ")
    assert "model_type 'evilllama'" in err and "--trust_remote_code" in err


# ------------------------------------------------------------------------------------- model / tokenizer dirs
def test_a_weights_file_linking_out_of_the_model_dir_is_refused(tmp_path):
    outside = _model_dir(tmp_path / "outside")
    model = tmp_path / "m"
    shutil.copytree(data.embedded_model_path(), model)
    (model / "model.safetensors").symlink_to(outside / "model.safetensors")
    _one_line(sources.run_source_problems(_args(model)), "model.safetensors -> ", "outside the directory you named")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to("../outside/model.safetensors")  # relative: the same
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").symlink_to(outside / "chat_template.jinja")
    _one_line(sources.run_source_problems(_args(model)), "chat_template.jinja -> ", "model.safetensors -> ")


@pytest.mark.parametrize(
    "entry, says",
    [
        ("../outside/model.safetensors", "climbs out with '..'"),
        ("sub/../../outside/model.safetensors", "climbs out with '..'"),
        ("/abs/model.safetensors", "is an absolute path"),
        ("linked/model.safetensors", "-> "),
    ],
)
def test_an_index_naming_files_outside_the_dir_is_refused(tmp_path, entry, says):
    _model_dir(tmp_path / "outside")
    model = tmp_path / "m"
    shutil.copytree(data.embedded_model_path(), model)
    (model / "linked").symlink_to(tmp_path / "outside")
    (model / files.SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"w": entry}}))
    _one_line(sources.run_source_problems(_args(model)), f"{files.SAFETENSORS_INDEX}: ", says)
    with pytest.raises(ValueError, match="hfpar reads only the files inside a checkpoint directory"):
        files.checkpoint_index(str(model))  # hfpar's own sharded reader (fsdp2 / TP / PP) refuses it too


def test_hub_cache_snapshots_and_the_embedded_models_load(tmp_path):
    """The HF cache's snapshots/<rev>/file -> ../../blobs/<hash> links stay inside the repo folder: allowed."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    _model_dir(blobs)
    snap.mkdir(parents=True)
    for f in sorted(blobs.iterdir()):
        (snap / f.name).symlink_to(Path("../../blobs", f.name))
    (snap / files.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    assert sources.run_source_problems(_args(snap)) == []
    assert files.checkpoint_index(str(snap)) == {"w": str(snap / "model.safetensors")}
    for name in data.EMBEDDED_MODELS:
        assert sources.run_source_problems(_args(data.embedded_model_path(name))) == []


def test_a_model_dir_holding_an_adapter_is_refused_before_loading(tmp_path):
    """transformers 5 loads config.json + adapter_config.json as the model with the adapter frozen onto it (an empty
    optimizer), and an adapter alone as the base its config names (elsewhere): one line each, saying what to do."""
    model = _model_dir(tmp_path / "m")
    (model / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere/base"}))
    _one_line(sources.run_source_problems(_args(model)), "PEFT adapter (adapter_config.json)", "merge_and_unload")
    (model / "config.json").unlink()
    _one_line(sources.run_source_problems(_args(model)), "no config.json", "'/elsewhere/base'", "--use_peft")


# ----------------------------------------------------------------------------------------------- datasets
def test_a_dataset_dir_file_linking_out_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "private.jsonl").write_text('{"text": "secret"}\n')
    ds = tmp_path / "ds"
    (ds / "nested").mkdir(parents=True)
    (ds / "nested" / "train.jsonl").symlink_to(secret / "private.jsonl")
    _one_line(
        sources.run_source_problems(_args(data.embedded_model_path(), ds)),
        "--dataset_name ",
        "nested/train.jsonl -> ",
    )
    with pytest.raises(data.DataError, match="outside the directory you named"):
        data.load_splits(str(ds), "clm")  # the loader itself refuses it too


# ---------------------------------------------------------------------------------------------- export
def test_export_says_it_reads_the_parent_and_follows_no_link_out_of_it(tmp_path, capsys):
    outside = _model_dir(tmp_path / "outside")
    run = tmp_path / "run"
    ckpt = run / "checkpoint-1"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    (run / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(SystemExit) as e:
        cli(["export", str(ckpt), str(tmp_path / "exported")])
    out, err = capsys.readouterr()
    assert f"{ckpt} has no config.json: the config is read from {run} (the run's output dir)" in out
    assert e.value.code == 2 and err.count("\n") == 1 and "config.json -> " in err, err
    assert not (tmp_path / "exported").exists()


# ------------------------------------------------------------------------------------ the refusal records
def _old(path: Path) -> Path:
    t = time.time() - 3 * 24 * 3600
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def test_pruning_the_refusal_records_never_follows_a_link(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(refusal.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29999")
    users = tmp_path / "users_data"
    users.mkdir()
    for name in ("a.txt", "b.txt"):
        (users / name).write_text("precious")
        _old(users / name)
    _old(users)
    root = tmp_path / f"hfpar-{os.getuid()}-refusals"
    root.mkdir(mode=0o755)
    (root / "someone-1").symlink_to(users)  # planted: a day-old directory of the user's files behind a link
    _old(root / "someone-1")
    stale = root / "host-2"
    stale.mkdir()
    (stale / "abc").write_text("x")
    (stale / "link").symlink_to(users / "a.txt")
    _old(stale / "abc")
    _old(stale)
    refusal.say("--tp_size 3 does not divide 2")
    assert sorted(p.name for p in users.iterdir()) == ["a.txt", "b.txt"]  # nothing outside touched
    assert (root / "someone-1").is_symlink()  # not a directory of hfpar's: left alone
    assert not (stale / "abc").exists() and (stale / "link").is_symlink()  # only its regular files went
    assert capsys.readouterr().err == "hfpar: error: --tp_size 3 does not divide 2\n"


def test_a_refusal_dir_that_is_not_private_is_not_used(tmp_path, monkeypatch, capsys):
    """Another local user may create <tmp>/hfpar-<uid>-refusals first (or make it a link): not used; the
    refusal is still said (by each rank), and XDG_RUNTIME_DIR's private folder serves when there is one."""
    monkeypatch.setattr(refusal.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29999")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"hfpar-{os.getuid()}-refusals").symlink_to(elsewhere)
    refusal.say("a problem")
    refusal.say("a problem")  # no shared record: said again (never lost)
    assert capsys.readouterr().err.count("hfpar: error: a problem\n") == 2
    assert list(elsewhere.iterdir()) == [] and refusal.agent_dir(1) is None
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    refusal.say("a problem")
    refusal.say("a problem")
    assert capsys.readouterr().err.count("hfpar: error: a problem\n") == 1
    assert refusal.agent_dir(1).parent == runtime / "hfpar-refusals" and refusal.peer_refused()
    (tmp_path / f"hfpar-{os.getuid()}-refusals").unlink()
    (tmp_path / f"hfpar-{os.getuid()}-refusals").mkdir(mode=0o777)
    os.chmod(tmp_path / f"hfpar-{os.getuid()}-refusals", 0o777)  # writable by others: not private either
    assert refusal.agent_dir(1).parent == runtime / "hfpar-refusals"
