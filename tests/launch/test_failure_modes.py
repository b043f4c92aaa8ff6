"""How a run fails and what it leaves: a save killed at each stage keeps the previous checkpoint, a non-finite loss
stops (or is skipped on every rank) before the optimizer step, a stuck rank ends in one clear timeout message, and two
nodes on loopback train as one process. Interrupted runs and their resumes: tests/launch/test_reliability.py.

    python -m pytest -q tests/launch/test_failure_modes.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import ROOT, env, launch, launch_cmd, read_metrics
from tests.helpers.parity import (
    COMMON,
    TOL,
    assert_close_series,
    assert_export_matches,
)
from tests.helpers.reliability import free_port as _free_port
from tests.helpers.reliability import wait_for as _wait_for
from tests.helpers.reliability import worker_pids as _worker_pids

pytestmark = pytest.mark.slow


SAVE_THEN_DIE = r"""
import os, signal, sys, torch
from accelerate import Accelerator
from hfpar.checkpoint import write as ckpt  # where a checkpoint is written (save_checkpoint, _fsync_tree)
acc = Accelerator(cpu=True)
torch.manual_seed(0)
lin = torch.nn.Linear(8, 8)
model, opt = acc.prepare(lin, torch.optim.AdamW(lin.parameters()))
out, where = sys.argv[1], sys.argv[2]
for step in (2, 4):
    ckpt.save_checkpoint(acc, out, step, {"global_step": step}, save_total_limit=1)
with torch.no_grad():
    model.weight.add_(1.0)
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if where == "state":      # while the training state is being written
    acc.save_model = die
    import accelerate.checkpointing as c; c.save = die
elif where == "fsync":    # state written, not yet flushed
    ckpt._fsync_tree = die
elif where == "rename":   # flushed, at the moment it would become checkpoint-6
    os.replace = die
ckpt.save_checkpoint(acc, out, 6, {"global_step": 6}, save_total_limit=1)
"""


# state / none on demand (-m extended, the suite's budget; fsync and rename are the two moments a half-written
# checkpoint could be mistaken for a whole one)
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("state", marks=pytest.mark.extended),
        "fsync",
        "rename",
        pytest.param("none", marks=pytest.mark.extended),
    ],
)
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, where):
    from hfpar.checkpoint.layout import list_checkpoints, resolve_resume

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_THEN_DIE, str(out), where],
        check=False,
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if where == "none":  # a save that completes: retention (limit 1) removes the older one, keeps the newest
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-6"]
        assert resolve_resume("latest", str(out)).name == "checkpoint-6"
        return
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # retention ran at step 4 and kept the newest complete checkpoint; the killed save never became one
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"]
    latest = resolve_resume("latest", str(out))
    assert latest.name == "checkpoint-4" and (latest / "COMPLETE").exists()
    assert not (out / "checkpoint-6").exists()
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(8, 8))
    acc.load_state(str(latest))  # loadable, and holds the weights from before the killed save
    torch.manual_seed(0)
    assert torch.equal(acc.unwrap_model(model).weight, torch.nn.Linear(8, 8).weight)


NAN = [
    "--max_steps",
    "5",
    "--learning_rate",
    "1e30",
    "--warmup_steps",
    "0",
    "--lr_scheduler_type",
    "constant",
    "--eval_steps",
    "0",
    "--logging_steps",
    "1",
    "--per_device_train_batch_size",
    "2",
]


def test_nonfinite_loss_stops_before_the_step(base_model, tmp_path):
    out = tmp_path / "nan"
    proc = launch("ddp", 2, "sft", [*NAN, "--model_name_or_path", base_model, "--output_dir", str(out)], check=False)
    assert proc.returncode != 0
    assert "hfpar: error: step 2: non-finite loss nan" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in "\n".join(x for x in proc.stderr.splitlines() if "hfpar" in x)
    assert [x["step"] for x in read_metrics(out)[0]] == [1]


def test_nonfinite_skip_skips_on_every_rank(base_model, tmp_path):
    out = tmp_path / "skip"
    launch(
        "ddp",
        2,
        "sft",
        [
            *NAN,
            "--on_nonfinite",
            "skip",
            "--save_steps",
            "1",
            "--save_total_limit",
            "10",
            "--model_name_or_path",
            base_model,
            "--output_dir",
            str(out),
        ],
    )
    train = read_metrics(out)[0]
    assert [x.get("skipped", False) for x in train] == [False, True, True, True, True]
    # no update after step 1: the export equals the step-1 checkpoint's weights
    step1 = load_file(str(out / "checkpoint-1" / "model.safetensors"))
    final = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(step1[k], final[k]) for k in final)
    proc = launch("zero2", 2, "sft", [*NAN, "--on_nonfinite", "skip", "--output_dir", str(tmp_path / "z")], check=False)
    assert proc.returncode != 0 and "hfpar: error: --on_nonfinite skip with zero2" in proc.stderr


def test_two_nodes_on_loopback_match_one_process(base_model, base_weights, single_run, tmp_path):
    """multi_node.yaml (FSDP2 over 2 machines), one process per 'node', machine ranks 0 and 1 on 127.0.0.1."""
    out, port = tmp_path / "2nodes", _free_port()
    procs = []
    for machine_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "multi_node.yaml"),
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--mixed_precision",
            "no",
            str(ROOT / "recipes" / "sft.py"),
            *COMMON,
            "--model_name_or_path",
            base_model,
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "2",
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    ref, got = read_metrics(single_run)[0], read_metrics(out)[0]
    assert_close_series(ref, got, "loss", TOL, "2 nodes")
    assert_close_series(ref, got, "grad_norm", TOL, "2 nodes")
    assert_export_matches(single_run, out, "2 nodes", initial=base_weights)


def test_a_stuck_rank_ends_in_a_clear_timeout_message(tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-run: rank 0's next collective times out after --dist_timeout_s and says so."""
    out = tmp_path / "hang"
    cmd = launch_cmd(
        "ddp",
        2,
        "sft",
        [
            "--max_steps",
            "500",
            "--save_steps",
            "2",
            "--eval_steps",
            "0",
            "--dist_timeout_s",
            "10",
            "--output_dir",
            str(out),
        ],
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _wait_for(out / "checkpoint-2" / "COMPLETE", proc)
        pids = _worker_pids(out)
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.time()
        while Path(f"/proc/{pids[0]}").exists() and time.time() - t0 < 120:
            time.sleep(0.2)
        waited = time.time() - t0
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert 9 < waited < 60, waited
    assert (
        "hfpar: error: rank 0: a collective timed out after --dist_timeout_s 10: another rank is stuck or died" in err
    ), err[-3000:]
