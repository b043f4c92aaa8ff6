"""Files users point a run at, refused in one line before any work: model weights missing / truncated / a shard of
the index absent, data files that are not UTF-8 (file and byte offset), misspelt accelerate-config keys.

    python -m pytest -q tests/unit/test_file_checks.py
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from hfpar.backends.launch_config import config_problems
from hfpar.checkpoint.file_checks import data_file_problems, weights_problems
from hfpar.config import ConfigError, parse_args


def _model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"w": torch.ones(64, 64)}, str(d / "model.safetensors"))
    return d


def test_model_weights_present_and_whole(tmp_path):
    d = _model(tmp_path)
    assert weights_problems(d) == []
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    [p] = weights_problems(d)
    assert p == f"{d / 'model.safetensors'}: truncated: {len(data) - 100} bytes, its header says {len(data)}"
    (d / "model.safetensors").unlink()
    assert weights_problems(d) == [f"{d}: no model weights (*.safetensors or pytorch_model*.bin) next to its config.json"]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors",
                                                                               "v": "model-00002-of-00002.safetensors"}}))
    assert "lists model-00001-of-00002.safetensors, which is missing (2 of 2 shards)" in weights_problems(d)[0]
    torch.save({"w": torch.ones(3)}, d / "pytorch_model.bin")
    (d / "model.safetensors.index.json").unlink()
    assert weights_problems(d) == []
    (d / "pytorch_model.bin").write_bytes((d / "pytorch_model.bin").read_bytes()[:50])
    assert "truncated or not a torch zip checkpoint" in weights_problems(d)[0]
    assert weights_problems("org/hub-id") == []


def test_data_file_not_utf8_names_the_byte_offset(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"text": "héllo"}\n' * 3, encoding="utf-8")
    assert data_file_problems(str(good)) == []
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n' * 70000 + b'{"text": "caf\xe9"}\n')  # latin-1, past the first 1 MiB block
    [p] = data_file_problems(str(bad))
    assert p.startswith(f"{bad}: not UTF-8 text at byte offset {15 * 70000 + 13} (invalid continuation byte)"), p
    assert data_file_problems(str(tmp_path)) == [p]   # a dir: its text files
    assert data_file_problems(None) == []


def test_misspelt_accelerate_config_keys_get_a_did_you_mean(tmp_path):
    cfg = tmp_path / "zero3.yaml"
    cfg.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 3\n  offload_param_device: none\n"
                   "fsdp_config:\n  fsdp_versoin: 2\n  reshard_after_forward: true\n")
    assert config_problems(cfg) == [
        (f"accelerate config {cfg}: deepspeed_config: unknown key 'zero_stag' (Accelerate would ignore it); "
         "did you mean 'zero_stage'?"),
        (f"accelerate config {cfg}: fsdp_config: unknown key 'fsdp_versoin' (Accelerate would ignore it); "
         "did you mean 'fsdp_version'?")]


def test_non_finite_numbers_are_refused_by_name():
    for flag in ("--learning_rate", "--max_grad_norm", "--warmup_ratio"):
        try:
            parse_args([flag, "nan"], recipe="sft")
        except ConfigError as exc:
            assert str(exc) == f"{flag} nan: must be a finite number"
        else:
            raise AssertionError(f"{flag} nan accepted")
    try:
        parse_args(["--weight_decay", "inf"], recipe="sft")
    except ConfigError as exc:
        assert str(exc) == "--weight_decay inf: must be a finite number"
