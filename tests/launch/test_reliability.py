"""Reliability: a crash costs only the steps since the last checkpoint.

    python -m pytest tests/launch/test_reliability.py -q

- SIGKILL of the whole job after a checkpoint, relaunch of the SAME command (`--resume_from_checkpoint
  latest` is in it from the start: harmless on a fresh run) -> same per-step losses and final weights
  as the uninterrupted run.
- Resume at another world size (DDP 2 -> 4 processes, FSDP2 2 -> 1, same global batch) and on another mesh through
  the checkpoint's full form (ZeRO-2 2 -> 1 process, ZeRO-3 -> FSDP2); `hfpar export` of each checkpoint kind.
- Preemption: SIGTERM under ddp.yaml (the real-SLURM case is test_slurm.py): a checkpoint, the same training.
  A damaged newest checkpoint: fallback to the previous one; a planted pickle: refused, never run. A finished run is
  never replaced silently.
All fp32 on CPU / gloo, 2-4 processes. A save killed mid-way, the non-finite guard, a stuck rank and two "nodes" on
one machine: tests/launch/test_failure_modes.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, env, launch, launch_cmd, read_metrics
from tests.helpers.parity import (
    assert_checkpoint_exports_final,
    assert_close_series,
    assert_continues_uninterrupted,
    assert_export_matches,
    assert_resumed_like_uninterrupted,
    resume_on_other_meshes,
)
from tests.helpers.reliability import assert_same_training as _assert_same_training
from tests.helpers.reliability import free_port as _free_port
from tests.helpers.reliability import run_args as _args
from tests.helpers.reliability import wait_for as _wait_for
from tests.helpers.reliability import worker_pids as _worker_pids

pytestmark = pytest.mark.slow


@pytest.fixture
def reference(ddp_reference) -> Path:
    """The uninterrupted DDP run (2 processes, tests/helpers/reliability.py), shared with test_slurm.py."""
    return ddp_reference


@pytest.mark.extended  # on demand since 2026-11-28 (budget): SIGTERM's relaunch, the damaged-checkpoint fallback stay
def test_sigkill_then_relaunch_same_command(reference, base_model, tmp_path):
    out = tmp_path / "killed"
    cmd = launch_cmd("ddp", 2, "sft", _args(base_model, out))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    _wait_for(out / "checkpoint-4" / "COMPLETE", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # launcher and every rank, no chance to clean up
    proc.wait()
    done = [x["step"] for x in read_metrics(out)[0]]
    assert max(done) < 16, "the run finished before it was killed: the test proved nothing"
    launch("ddp", 2, "sft", _args(base_model, out))  # the same command again
    _assert_same_training(reference, out, "SIGKILL + relaunch")


# on demand (-m extended): static since 2026-11-28 (the suite's budget), c10d before
@pytest.mark.parametrize("rdzv", [pytest.param(r, marks=pytest.mark.extended) for r in ("static", "c10d")])
def test_elastic_restart_after_a_rank_dies(reference, base_model, tmp_path, rdzv):
    """`accelerate launch --max_restarts 1`: rank 1 is SIGKILLed after checkpoint-4; torchrun restarts both
    ranks, which resume from the latest checkpoint (a new store prefix per attempt: hfpar.distributed).
    static: accelerate's default single-node rendezvous; c10d: the one scripts/slurm uses across nodes."""
    out = tmp_path / "elastic"
    extra = ["--max_restarts", "1", "--monitor_interval", "0.1"]
    if rdzv == "c10d":
        extra += ["--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port())]
    cmd = launch_cmd("ddp", 2, "sft", _args(base_model, out), extra)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        _wait_for(out / "checkpoint-4" / "COMPLETE", proc)
        os.kill(_worker_pids(out)[1], signal.SIGKILL)
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"the restarted job failed:\n{log[-6000:]}"
    assert "(torchrun restart attempt 1)" in log, f"no restart happened:\n{log[-3000:]}"
    _assert_same_training(reference, out, "elastic restart")


def test_resume_on_a_different_world_size(reference, base_model, base_weights, tmp_path):
    """Written by 2 processes, resumed by 4 (per-device batch halved): same global batch, same training. (FSDP2's
    sharded state at 2 -> 1 process: test_zero_resumes_on_another_mesh[fsdp2_to_fsdp2x1].)"""
    config, src_n, dst_n = "ddp", 2, 4
    src, out = reference, tmp_path / "dst"  # the uninterrupted DDP run (2 processes) is the source
    out.mkdir()
    shutil.copytree(src / "checkpoint-8", out / "checkpoint-8")
    proc = launch(config, dst_n, "sft", _args(base_model, out, per_device=4 // dst_n))
    assert "resumed from" in proc.stdout + proc.stderr
    what = f"{config} {src_n} -> {dst_n} processes"
    ref, got = read_metrics(src)[0], read_metrics(out)[0]
    assert [x["step"] for x in got] == list(range(9, 17))
    assert_close_series(ref[8:], got, "loss", 1e-5, what)
    assert_close_series(ref[8:], got, "grad_norm", 1e-5, what)
    assert_export_matches(src, out, what, tol=1e-5, initial=base_weights)


@pytest.fixture(scope="module")
def zero_resharded(backend_runs, base_model, tmp_path_factory) -> dict:
    """The parity runs' checkpoint-4 resumed on another mesh: ZeRO-2's by 1 process, ZeRO-3's under FSDP2, FSDP2's
    (DCP shards of 2 ranks) by 1 process."""
    cases = {
        "zero2_to_zero2x1": (backend_runs["zero2"], ("zero2", 1, "4", [])),
        "zero3_to_fsdp2x2": (backend_runs["zero3"], ("fsdp2", 2, "2", [])),
        "fsdp2_to_fsdp2x1": (backend_runs["fsdp2"], ("fsdp2", 1, "4", [])),
    }
    return resume_on_other_meshes(cases, base_model, tmp_path_factory.mktemp("zero_resharded"))


@pytest.mark.parametrize(
    "case, src", [("zero2_to_zero2x1", "zero2"), ("zero3_to_fsdp2x2", "zero3"), ("fsdp2_to_fsdp2x1", "fsdp2")]
)
def test_zero_resumes_on_another_mesh(zero_resharded, backend_runs, base_weights, case, src):
    """DeepSpeed's flat partitions joined into full tensors (weights and AdamW states) and loaded through the new
    layout: ZeRO-2 at 2 -> 1 process (DeepSpeed's fragment setters), ZeRO-3 -> FSDP2 (DTensor shards)."""
    assert_continues_uninterrupted(backend_runs[src], zero_resharded[case], case, initial=base_weights)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "zero2", "zero3"])
def test_checkpoint_export_equals_the_final_export(backend_runs, tmp_path, kind):
    assert_checkpoint_exports_final(backend_runs[kind], tmp_path, kind)


def _tail(proc) -> str:
    return (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:]


def test_sigterm_saves_at_the_next_step_and_the_relaunch_resumes(reference, base_model, tmp_path):
    """SIGTERM to the whole job (what SLURM and Kubernetes send): every rank saves a checkpoint at the next step
    boundary and exits (75 from the workers, and from `hfpar launch`, itself signalled); the same command relaunched
    resumes there and ends like the
    uninterrupted run. Checkpoints every 100 steps: the one found can only be the preemption's."""
    out = tmp_path / "preempted"
    args = [*_args(base_model, out), "--save_steps", "100"]
    proc = subprocess.Popen(
        launch_cmd("ddp", 2, "sft", args, launcher="hfpar.launch"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(out / "metrics.jsonl", proc)  # the first step is logged: training is under way
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher and both ranks, as SLURM signals a job step
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ckpts = sorted(out.glob("checkpoint-*"))
    assert proc.returncode == 75 and len(ckpts) == 1, (
        proc.returncode,
        ckpts,
        err[-3000:],
    )  # hfpar launch: the workers' 75
    assert "Traceback" not in err, err[-3000:]
    step = int(ckpts[0].name.split("-")[1])
    assert 1 <= step < 16 and f"hfpar: preempted: SIGTERM received: saved checkpoint-{step}" in err, err[-3000:]
    assert [x["step"] for x in read_metrics(out)[0]][-1] == step
    launch("ddp", 2, "sft", args)  # the same command again
    _assert_same_training(reference, out, f"SIGTERM at step {step} + relaunch")


def test_a_damaged_newest_checkpoint_falls_back_and_a_planted_pickle_never_runs(reference, base_model, tmp_path):
    """checkpoint-14 of the uninterrupted run with its optimizer state truncated: `latest` warns in one line and
    resumes checkpoint-12, ending like the uninterrupted run. Then a pickle payload planted in checkpoint-14's
    optimizer.bin, its manifest re-signed (an attacker with write access): refused in one line, the payload never
    runs. Then every file of the checkpoint planted in turn and read as its library reads it (no launch)."""
    from hfpar.checkpoint.manifest import write_manifest
    from tests.helpers.planting import assert_no_planted_payload_runs, plant

    out = tmp_path / "damaged"
    out.mkdir()
    for step in (12, 14):
        shutil.copytree(reference / f"checkpoint-{step}", out / f"checkpoint-{step}")
    opt = out / "checkpoint-14" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[:100])
    proc = launch("ddp", 2, "sft", _args(base_model, out))
    assert f"hfpar: warning: skipping checkpoint-14: {opt}: 100 bytes, the manifest says" in proc.stderr
    assert "resumed from" in proc.stdout and "checkpoint-12 at step 12" in proc.stdout, _tail(proc)
    r, g = read_metrics(reference)[0], read_metrics(out)[0]
    assert [x["step"] for x in g] == list(range(13, 17))
    assert_close_series(r[12:], g, "loss", 1e-6, "fallback to checkpoint-12")
    assert_close_series(r[12:], g, "grad_norm", 1e-6, "fallback to checkpoint-12")
    assert_resumed_like_uninterrupted(reference, out, "fallback to checkpoint-12")

    planted = tmp_path / "planted"
    planted.mkdir()
    shutil.copytree(reference / "checkpoint-14", planted / "checkpoint-14")
    marker = tmp_path / "PAYLOAD_RAN"
    plant(planted / "checkpoint-14" / "optimizer.bin", marker)
    write_manifest(planted / "checkpoint-14")
    proc = launch("ddp", 2, "sft", _args(base_model, planted), check=False)
    assert proc.returncode != 0 and not marker.exists(), _tail(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hfpar: error:")]
    assert len(lines) == 1 and "optimizer.bin: refused to unpickle it" in lines[0], _tail(proc)
    assert assert_no_planted_payload_runs(reference / "checkpoint-14", tmp_path / "each") >= 8


def test_overwrite_output_dir_with_latest_never_resumes_the_old_run(reference, base_model, tmp_path):
    """The issue's case: a finished 16-step run's dir (final model, metrics, checkpoint-12). Relaunched with
    --overwrite_output_dir --resume_from_checkpoint latest --max_steps 2: the old run is set aside (said in one line)
    and the new run trains from step 0, never from the old checkpoint. (The refusals without the flag, of another
    run's checkpoint and of one past --max_steps, are tested in process: test_preflight.py.)"""
    from hfpar.checkpoint.layout import list_checkpoints

    out = tmp_path / "finished"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-*"))
    shutil.copytree(reference / "checkpoint-12", out / "checkpoint-12")
    before = (out / "model.safetensors").read_bytes()
    proc = launch(
        "ddp", 2, "sft", [*_args(base_model, out), "--max_steps", "2", "--save_steps", "0", "--overwrite_output_dir"]
    )
    assert "previous run's checkpoints and records" in proc.stderr and "resumed from" not in proc.stdout, _tail(proc)
    got = read_metrics(out)[0]
    assert [x["step"] for x in got] == [1, 2] and not list_checkpoints(out)
    aside = next((out / ".replaced").iterdir())
    assert (aside / "checkpoint-12").is_dir() and (aside / "model.safetensors").read_bytes() == before
    assert (out / "model.safetensors").read_bytes() != before
