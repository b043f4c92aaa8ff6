"""What the reliability tests share: the 16-step DDP run they interrupt and resume, and how two runs are compared.

16 steps of global batch 8, a checkpoint every 2: a kill at checkpoint-4 leaves 12 steps to redo. The uninterrupted
run is the session fixture `ddp_reference` (tests/conftest.py), built once for every module that uses it.
"""

from __future__ import annotations

import socket
import subprocess
import time
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


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared"
        assert time.time() - t0 < timeout, f"{path} did not appear in {timeout}s"
        time.sleep(0.02)


def worker_pids(out: Path) -> dict[int, int]:
    """{RANK: pid} of the training processes whose command line names `out` (Linux /proc)."""
    pids = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            environ = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if str(out).encode() in cmd and b"RANK" in environ and b"sft.py" in b" ".join(cmd):
            pids[int(environ[b"RANK"])] = int(d.name)
    return pids
