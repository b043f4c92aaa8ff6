"""Nothing lost, nothing run, nothing unsaid, in whole runs (the unit cases: tests/unit/test_output_dir.py).

    python -m pytest -q tests/launch/test_output_dir.py

- A problem found by rank 1 alone (before the process group exists, and after it, while rank 0 waits in a
  collective) reaches the user in its one line, every time, with no traceback and exit code 2 (`hfpar launch`).
- Two runs into one --output_dir: the second is refused in one line naming the first; the first finishes intact.
- A model directory with auto_map and custom code, run under a terminal that answers "y": no code runs in
  training, `hfpar plan` or `hfpar export` without --trust_remote_code; each is refused in one line.
Single-process runs where one process shows it (cheaper); 2 processes for the rank cases.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, env, launch, read_metrics
from tests.unit.test_output_dir import custom_code_model, long_prompts

pytestmark = pytest.mark.slow  # whole runs: 2-process launches, and single processes of ~10-25 s each

REFUSE_ON_RANK = str(ROOT / "tests" / "helpers" / "refuse_on_rank.py")


def _only_the_line(proc, line: str) -> None:
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and err == [f"hfpar: error: {line}"], (proc.returncode, proc.stderr[-3000:])


@pytest.mark.parametrize(
    "where,line",
    [
        ("options", "rank 1 only: --planted_option 7 is refused"),
        # after the process group exists: on demand since 2026-11-28 (the suite's budget); it passed before
        pytest.param("data", "rank 1 only: tokenizer /planted unreadable", marks=pytest.mark.extended),
    ],
)
def test_a_refusal_found_on_rank_1_only_is_said_every_time(tmp_path, where, line):
    """Before the group exists rank 0 goes on into the rendezvous; after it, into the data's barrier: either way it
    loses its peer, and leaves quietly with the same code. The case of the issue (2 of 3 tries lost the line) is
    repeated; the options case also under `accelerate launch`, whose own ChildFailedError traceback then follows the
    line (no worker can prevent it: docs/reliability.md), its root cause the refusing rank and its line (the elastic
    error file hfpar writes); `hfpar launch` ends with the line alone."""
    for attempt in range(2):
        launcher = "accelerate.commands.launch" if where == "options" and attempt == 1 else "hfpar.launch"
        proc = launch(
            "ddp",
            2,
            REFUSE_ON_RANK,
            [where, "--output_dir", str(tmp_path / f"o{attempt}")],
            check=False,
            launcher=launcher,
        )
        if launcher == "hfpar.launch":
            _only_the_line(proc, line)
            continue
        said = [x for x in proc.stderr.splitlines() if x.startswith("hfpar: ")]
        assert proc.returncode == 1 and said == [f"hfpar: error: {line}"], proc.stderr[-3000:]
        assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
        root_cause = proc.stderr.split("Root Cause")[-1]  # the summary names the refusal (hfpar's error file)
        assert f"traceback : hfpar: error: {line}" in root_cause and "rank      : 1" in root_cause, root_cause


def _sft(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "recipes" / "sft.py"), "--output_dir", str(out), *extra]


def test_a_second_run_into_the_same_output_dir_is_refused_and_the_first_finishes_intact(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(
        _sft(out, "--max_steps", "6", "--eval_steps", "0", "--logging_steps", "1"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        t0 = time.time()
        while not (out / ".hfpar.lock").exists():
            assert first.poll() is None and time.time() - t0 < 120, first.communicate()
            time.sleep(0.05)
        holder = json.loads((out / ".hfpar.lock").read_text())
        first.send_signal(signal.SIGSTOP)  # paused while the second starts: the two surely overlap
        try:
            second = subprocess.run(
                _sft(out, "--max_steps", "3"),
                cwd=ROOT,
                env=env(),
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        finally:
            first.send_signal(signal.SIGCONT)
        _only_the_line(
            second,
            f"--output_dir {out} is in use by another run (pid {first.pid} on {holder['host']}, "
            f"started {holder['started']}; lock {out / '.hfpar.lock'}): wait for it to finish, "
            "or pick another --output_dir",
        )
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, 7))  # one run's records, not two interleaved
    assert (out / "model.safetensors").is_file() and not (out / ".hfpar.lock").exists()


def _under_a_terminal(cmd: list[str]) -> subprocess.CompletedProcess:
    """cmd with a pseudo-terminal as stdin that answers "y" to any question (transformers' custom-code prompt)."""
    master, slave = pty.openpty()
    try:
        os.write(master, b"y\ny\ny\n")
        return subprocess.run(
            cmd, cwd=ROOT, env=env(), stdin=slave, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        os.close(master)
        os.close(slave)


def test_custom_code_never_runs_without_the_flag_under_a_terminal_answering_yes(tmp_path):
    model = custom_code_model(tmp_path / "run" / "checkpoint-1")  # a model dir, and a checkpoint for export
    hfpar = [sys.executable, "-m", "hfpar.cli"]
    for cmd, option in (
        (_sft(tmp_path / "o", "--model_name_or_path", str(model)), "--model_name_or_path"),
        ([*hfpar, "plan", "--model", str(model), "--num_gpus", "8", "--gpu_memory_gb", "80"], "--model"),
        ([*hfpar, "export", str(model), str(tmp_path / "exported")], "CHECKPOINT_DIR's files in"),
    ):
        proc = _under_a_terminal(cmd)
        _only_the_line(
            proc,
            f"{option} {model}: config.json has auto_map (custom code: configuration_evil.py, modeling_evil.py), which "
            "transformers would run; hfpar runs no code from a model directory unless you pass "
            "--trust_remote_code (read that code first)",
        )
        assert not (model / "CODE_RAN").exists(), cmd
    assert not (tmp_path / "exported").exists() and not (tmp_path / "o").exists()


def test_examples_lost_to_truncation_are_announced(tmp_path):
    """The issue's case (own data, default --max_seq_length 128, half the examples' replies cut away): one line
    before training says how many and why (almost none left, refused: tests/unit/test_recipe_errors.py)."""
    data = long_prompts(tmp_path / "most.jsonl", lost=30, kept=20)
    proc = subprocess.run(
        _sft(
            tmp_path / "o",
            "--dataset_name",
            str(data),
            "--max_steps",
            "1",
            "--eval_steps",
            "0",
            "--per_device_train_batch_size",
            "4",
            "--save_final_model",
            "false",
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [x for x in proc.stdout.splitlines() if x.startswith("[hfpar] train data:")]
    assert (
        len(said) == 1
        and "examples left out (" in said[0]
        and "with every target token past --max_seq_length 128" in said[0]
    ), proc.stdout
    assert " cut to " not in said[0], said  # a row whose reply was cut away is counted once, as left out
