"""What a refusal leaves for torchrun's agent (the launcher inside `accelerate launch`): the worker's elastic error
file, read back here by torch's own ProcessFailure, as the agent does when it builds its ChildFailedError summary.
The whole launch (2 processes, plain `accelerate launch`, rank 1 refusing): tests/launch/test_output_dir.py.

    python -m pytest -q tests/unit/test_refusal_launcher.py
"""

from __future__ import annotations

from pathlib import Path

import accelerate.commands.launch as accelerate_launch
import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hfpar import launch
from hfpar.checkpoint.checkpointer import PREEMPTED_EXIT
from hfpar.observe import refusal

ROOT = Path(__file__).resolve().parents[2]


def _failure(path, code: int) -> ProcessFailure:
    return ProcessFailure(local_rank=1, pid=4242, exitcode=code, error_file=str(path))


def test_a_refusal_is_the_root_cause_the_launcher_prints(tmp_path, monkeypatch, capsys):
    path = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # one process: the line is printed, no launch directory
    with pytest.raises(SystemExit) as exc:
        refusal.fail("--tp_size 3 does not divide the world size 2\nanother problem")
    assert exc.value.code == refusal.REFUSED_EXIT
    assert capsys.readouterr().err.splitlines() == [
        "hfpar: error: --tp_size 3 does not divide the world size 2",
        "hfpar: error: another problem",
    ]
    failure = _failure(path, refusal.REFUSED_EXIT)
    assert (
        failure.message == "hfpar: error: --tp_size 3 does not divide the world size 2\nhfpar: error: another problem"
    )
    assert failure.timestamp > 0


def test_a_preemption_says_how_to_go_on_and_keeps_its_code(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    @refusal.guarded
    def main():
        raise SystemExit(PREEMPTED_EXIT)

    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == refusal.PREEMPTED_EXIT == PREEMPTED_EXIT
    assert _failure(path, PREEMPTED_EXIT).message.startswith("hfpar: preempted: ")
    assert "--resume_from_checkpoint latest" in _failure(path, PREEMPTED_EXIT).message


def test_outside_a_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    refusal.tell_launcher("a problem")
    assert list(tmp_path.iterdir()) == []


def test_hfpar_launch_says_a_zero_config_without_deepspeed_in_one_line(monkeypatch, capsys):
    """Accelerate's DeepSpeed launcher raises ImportError when deepspeed is missing: `hfpar launch` says it in one
    line, exit 2 (nothing is launched: any other launcher reached here fails the test)."""

    def launched(args):
        raise AssertionError("a launcher other than DeepSpeed's was reached")

    monkeypatch.setattr(accelerate_launch, "is_deepspeed_available", lambda: False)
    for name in ("multi_gpu_launcher", "simple_launcher"):
        monkeypatch.setattr(accelerate_launch, name, launched)
    config = str(ROOT / "accelerate_configs" / "zero3.yaml")
    with pytest.raises(SystemExit) as exc:
        launch.main(["--config_file", config, "--num_processes", "2", str(ROOT / "recipes" / "sft.py")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hfpar: error: this accelerate config asks for DeepSpeed"), err


def test_hfpar_launch_exits_with_the_refusal_whichever_failure_the_agent_saw_first(tmp_path, monkeypatch, capsys):
    """Rank 1 refused (its error file written) and was still exiting when rank 0 left with the same code: the agent
    SIGTERMs rank 1 (-15), whose earlier timestamp makes it the first failure. `hfpar launch` exits 2, quietly."""
    refused = tmp_path / "error.json"
    refused.write_text('{"message": "hfpar: error: rank 1 only", "timestamp": 1}')
    failures = {0: _failure(tmp_path / "none.json", refusal.REFUSED_EXIT), 1: _failure(refused, -15)}
    failures[0].local_rank = 0

    def launch_command(args):
        raise ChildFailedError("sft.py", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    assert ChildFailedError("sft.py", failures).get_first_failure()[0] == 1  # the case: the first one is -15
    with pytest.raises(SystemExit) as exc:
        launch.main([str(ROOT / "recipes" / "sft.py")])
    assert exc.value.code == refusal.REFUSED_EXIT and capsys.readouterr().err == ""
