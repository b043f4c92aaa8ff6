"""Files users point a run at, refused in one line before any work: model weights missing / truncated / a shard of
the index absent, data files that are not UTF-8 (file and byte offset), misspelt accelerate-config keys.

    python -m pytest -q tests/unit/test_file_checks.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hfpar.backends.launch_config import config_problems, launcher_config_file
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
    assert weights_problems(d) == [
        f"{d}: no model weights (*.safetensors or pytorch_model*.bin) next to its config.json"
    ]
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}})
    )
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
    assert data_file_problems(str(tmp_path)) == [p]  # a dir: its text files
    assert data_file_problems(None) == []


def test_misspelt_accelerate_config_keys_get_a_did_you_mean(tmp_path):
    cfg = tmp_path / "zero3.yaml"
    cfg.write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 3\n  offload_param_device: none\n"
        "fsdp_config:\n  fsdp_versoin: 2\n  reshard_after_forward: true\n"
    )
    assert config_problems(cfg) == [
        (
            f"accelerate config {cfg}: deepspeed_config: unknown key 'zero_stag' (Accelerate would ignore it); "
            "did you mean 'zero_stage'?"
        ),
        (
            f"accelerate config {cfg}: fsdp_config: unknown key 'fsdp_versoin' (Accelerate would ignore it); "
            "did you mean 'fsdp_version'?"
        ),
    ]


def test_the_launchers_config_file_is_found_on_its_command_line(tmp_path):
    """Under `accelerate launch` every rank's parent is the launcher: its --config_file (relative to its working
    dir) is the YAML checked; a process not started by accelerate has none."""
    cfg = tmp_path / "z.yaml"
    cfg.write_text("deepspeed_config:\n  zero_stag: 3\n")
    fake = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)  # accelerate launch stand-in", "--config_file", "z.yaml"],
        cwd=tmp_path,
    )
    try:
        t0 = time.time()
        while b"z.yaml" not in Path(f"/proc/{fake.pid}/cmdline").read_bytes() and time.time() - t0 < 10:
            time.sleep(0.01)
        assert launcher_config_file(fake.pid) == cfg
        assert "did you mean 'zero_stage'?" in config_problems(launcher_config_file(fake.pid))[0]
    finally:
        fake.kill()
        fake.wait()
    assert launcher_config_file(os.getpid()) is None  # pytest itself: not a launcher


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
