"""`hfpar export` inputs it refuses, one line each (exports of real DDP / FSDP2 / ZeRO-3 checkpoints are
tested in tests/launch/test_plan.py, which shares their launches).

    python -m pytest -q tests/unit/test_export.py
"""

from __future__ import annotations

import pytest
import torch

from hfpar.cli import main as cli


def export_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli(["export", *map(str, argv)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("hfpar: error: ") and err.count("\n") == 1, err
    return err


def test_missing_checkpoint_dir(tmp_path, capsys):
    assert "no such checkpoint directory" in export_error(capsys, tmp_path / "checkpoint-9", tmp_path / "out")


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint-1").mkdir()
    assert "no model state found" in export_error(capsys, tmp_path / "checkpoint-1", tmp_path / "out")


def test_per_rank_files_without_a_piece_layout_are_refused_with_the_way_out(tmp_path, capsys):
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    torch.save({"model": {}}, ckpt / "tp_rank00_of02.pt")  # an older hfpar's: no piece layout
    err = export_error(capsys, ckpt, tmp_path / "out")
    assert "per-rank file without the piece layout" in err and "final model" in err


def test_model_parallel_zero_shards_are_refused_before_deepspeed(tmp_path, capsys):
    """TP / EP x ZeRO: DeepSpeed's `latest` is there too, but its state holds rank 0's shards only."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step2")
    torch.save({"experts": []}, ckpt / "rank000_of002.pt")
    err = export_error(capsys, ckpt, tmp_path / "out")
    assert "per-rank file without the piece layout" in err and "final model" in err


def test_pipeline_stages_are_refused_before_deepspeed(tmp_path, capsys):
    """PP x ZeRO-1: DeepSpeed's checkpoint holds one model-state file per stage, which zero_to_fp32 cannot merge."""
    import json

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "latest").write_text("pytorch_model")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2, "pp": 2, "strategy": "zero1"}))
    err = export_error(capsys, ckpt, tmp_path / "out")
    assert "DeepSpeed partitions per pipeline stage, which have no full form" in err and "final model" in err


def test_checkpoint_without_config(tmp_path, capsys):
    from safetensors.torch import save_file

    ckpt = tmp_path / "run" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    assert "no config.json" in export_error(capsys, ckpt, tmp_path / "out")


def test_weights_not_matching_the_config(tmp_path, capsys):
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from hfpar import data

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    config = AutoConfig.from_pretrained(data.embedded_model_path())
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(ckpt)
    save_file({"w": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    assert "weights do not match LlamaForCausalLM" in export_error(capsys, ckpt, tmp_path / "out")
