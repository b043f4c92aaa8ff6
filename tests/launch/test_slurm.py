"""A real SLURM (Debian's slurm-wlm + munge, started by the test with its own config, sockets and ports) runs
scripts/slurm/hfpar.sbatch: SIGUSR1 ahead of the time limit, a checkpoint on every rank, a requeue, the resume, and the
same training as the uninterrupted run (losses, grad norms, final weights). Skipped where slurm-wlm is not installed.

    python -m pytest tests/launch/test_slurm.py -q
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, env
from tests.helpers.reliability import assert_same_training, free_port, run_args

pytestmark = pytest.mark.slow


SLURM_CONF = """ClusterName=hfpartest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=60
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real SLURM on this machine (Debian's slurm-wlm + munge): munged, slurmctld and one slurmd, started here
    with their own config, sockets and ports, stopped after the module. Skipped where they are not installed."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"real-SLURM test: {', '.join(missing)} not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("real-SLURM test: the daemons run as root here (SlurmUser=root)")
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool"):
        (root / d).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(host=host, root=root, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count())
    )
    e = {**env(), "SLURM_CONF": str(conf), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    subprocess.run(
        [
            "munged",
            f"--key-file={key}",
            f"--socket={root}/munge.socket",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munge.seed",
            "-f",
        ],
        check=True,
        env=e,
    )
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=e)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=e)
    try:
        t0 = time.time()
        while "idle" not in _node_state(e):
            assert time.time() - t0 < 60, (root / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)
        yield e | {"HFPAR_TEST_SLURM_ROOT": str(root)}
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):  # the daemons this fixture started, by id
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((root / pid_file).read_text()), signal.SIGTERM)


def _node_state(e: dict) -> str:
    return subprocess.run(
        ["sinfo", "-h", "-o", "%T"], check=False, env=e, capture_output=True, text=True
    ).stdout.strip()


def _report(log: Path, e: dict) -> str:
    """The job's output and the daemons' logs: what a failure needs to be understood from CI's output alone."""
    root = Path(e["HFPAR_TEST_SLURM_ROOT"])
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
        for p in (log, root / "slurmctld.log", root / "slurmd.log")
        if p.exists()
    )


def _job_state(job: str, e: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], check=False, env=e, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "GONE")


def test_real_slurm_preemption_requeues_and_resumes(slurm, ddp_reference, base_model, tmp_path):
    """scripts/slurm/hfpar.sbatch submitted with sbatch (one node, 2 CPU processes of ddp.yaml: its GPU request
    removed), SIGUSR1 sent as SLURM does ahead of the time limit (`scancel --signal=USR1 --batch`): the script's trap
    sends SIGTERM to the job step, every rank saves a checkpoint and exits, the job requeues itself and the requeued run
    resumes; the losses and final weights equal the uninterrupted run's.

    SLURM delays a requeued job by 2 minutes; the test starts it early (scontrol update StartTime=now), but only once
    the node has finished the first run and a new second has begun: slurmd revokes the old run's job credential with
    a one-second timestamp, and a relaunch within the same second is killed as "Job credential revoked" (seen in CI).
    The 2-minute delay exists to avoid exactly that, so a real requeue never meets it."""
    out = tmp_path / "slurm_run"
    script = tmp_path / "hfpar.sbatch"
    text = (ROOT / "scripts" / "slurm" / "hfpar.sbatch").read_text()
    script.write_text("\n".join(x for x in text.splitlines() if "--gpus-per-node" not in x) + "\n")
    e = {
        **slurm,
        "CONFIG": "accelerate_configs/ddp.yaml",
        "GPUS_PER_NODE": "2",
        "MAIN_PORT": str(free_port()),
        "EXTRA_LAUNCH_ARGS": "--mixed_precision no",
    }
    log = tmp_path / "job.out"
    args = [*run_args(base_model, out), "--save_steps", "100"]
    args.remove("--resume_from_checkpoint")
    args.remove("latest")  # the script passes it
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            f"--cpus-per-task={os.cpu_count()}",
            "--open-mode=append",
            f"--output={log}",
            f"--chdir={ROOT}",
            str(script),
            *args,
        ],
        env=e,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        t0 = time.time()
        while not (out / "metrics.jsonl").exists():
            assert _job_state(job, e) in ("PENDING", "RUNNING") and time.time() - t0 < 300, _report(log, e)
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=e, check=True)
        while _job_state(job, e) != "PENDING" or _node_state(e) != "idle":  # requeued, first run's steps done
            assert time.time() - t0 < 400, _report(log, e)
            time.sleep(0.2)
        time.sleep(2.0)  # past the second in which the old credential was revoked
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=e, check=True)
        while _job_state(job, e) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
            assert time.time() - t0 < 900, _report(log, e)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], check=False, env=e, capture_output=True)
    text = log.read_text(errors="replace")  # two ranks write the one log: a multi-byte character can be split
    assert _job_state(job, e) in ("COMPLETED", "GONE"), _report(log, e)
    assert (
        "hfpar: SIGUSR1 (time limit near)" in text and "hfpar: preempted: SIGTERM received: saved checkpoint-" in text
    )
    assert "resumed from" in text, _report(log, e)
    assert_same_training(ddp_reference, out, "real SLURM: SIGUSR1, requeue, resume")
