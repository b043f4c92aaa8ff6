"""What the reliability tests share: the 16-step DDP run they interrupt and resume, and how two runs are compared.

16 steps of global batch 8, a checkpoint every 2: a kill at checkpoint-4 leaves 12 steps to redo. The uninterrupted
run is the session fixture `ddp_reference` (tests/conftest.py), built once for every module that uses it.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.helpers.launch import read_metrics
from tests.helpers.parity import assert_close_series, assert_resumed_like_uninterrupted

RUN = [
    "--max_steps",
    "16",
    "--save_steps",
    "2",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "2e-3",
    "--warmup_steps",
    "2",
    "--logging_steps",
    "1",
    "--eval_steps",
    "0",
    "--resume_from_checkpoint",
    "latest",
]


def run_args(base_model: str, out: Path, per_device: int = 2) -> list[str]:
    return [
        *RUN,
        "--model_name_or_path",
        base_model,
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        str(per_device),
    ]


def assert_same_training(ref: Path, got: Path, what: str) -> None:
    r, g = read_metrics(ref)[0], read_metrics(got)[0]
    assert [x["step"] for x in g] == list(range(1, 17)), f"{what}: steps {[x['step'] for x in g]}"
    assert_close_series(r, g, "loss", 1e-6, what)
    assert_close_series(r, g, "grad_norm", 1e-6, what)
    assert_resumed_like_uninterrupted(ref, got, what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
