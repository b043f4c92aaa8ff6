"""`accelerate launch` that exits with the workers' exit code and adds no traceback of its own.

    hfpar launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py --max_steps 100      (same arguments)
    python -m hfpar.launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/sft.py

Accelerate's launcher (torchrun's agent inside) raises ChildFailedError when a worker exits non-zero: ~40 lines of
launcher traceback after the worker's own one-line refusal, and exit code 1 whatever the workers said, so a requeue
script cannot tell a preemption (the workers' 75, hfpar.checkpoint.checkpointer.PREEMPTED_EXIT) from a failure.
Here the launch is the same (accelerate's parser and launch_command, nothing patched); only its ending differs:
the exit code of the first worker that failed (2: a refusal, already said by that worker; 75: preempted, relaunch
with --resume_from_checkpoint latest), and one line naming the rank for any other failure (its traceback is above,
in the worker's own output). A ZeRO config without DeepSpeed installed is said in one line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

QUIET_CODES = (2, 75)  # a refusal (said by the worker) and a preemption (said by the worker)


def _fail(line: str, code: int) -> None:
    print(f"hfpar: error: {line}", file=sys.stderr)
    sys.exit(code)


def _worker_code() -> int | None:
    """75 when a worker of this launch recorded a preemption (hfpar.observe.refusal.record_exit), else 2 for a
    refusal."""
    from hfpar.observe.refusal import recorded_exits  # noqa: PLC0415  (the launcher imports no hfpar until it ends)

    codes = recorded_exits(os.getpid())
    return next((c for c in QUIET_CODES[::-1] if c in codes), None)


def _exit_codes(exc) -> set[int]:
    """Every failed worker's exit code (a ChildFailedError's failures)."""
    return {f.exitcode for f in exc.failures.values()}


def main(argv: list[str] | None = None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    parser = launch_command_parser()
    parser.prog = "hfpar launch"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's agent logs each failed worker at ERROR ("failed (exitcode: 2) local_rank: 0 ..."): the worker said why
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except SignalException as exc:  # the launcher itself signalled (SLURM / Kubernetes signal the whole job)
        code = _worker_code() or 128 + int(exc.sigval)
        if code in QUIET_CODES:
            sys.exit(code)
        _fail(f"the launch was stopped by {signal.Signals(exc.sigval).name}", code)
    except ChildFailedError as exc:
        # The agent stops the other workers (SIGTERM) once one fails: a rank still exiting after its refusal may be
        # the first failure by timestamp (-15), so any worker's refusal / preemption code decides, not the first's.
        said = _worker_code() or next((c for c in QUIET_CODES[::-1] if c in _exit_codes(exc)), None)
        if said:
            sys.exit(said)
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        _fail(f"rank {rank} exited with code {code} (its own output above says why)", code if code > 0 else 1)
    except subprocess.CalledProcessError as exc:  # one process (accelerate's simple launcher)
        code = exc.returncode
        if code in QUIET_CODES:
            sys.exit(code)
        _fail(f"the training process exited with code {code} (its own output above says why)", code if code > 0 else 1)
    except ImportError as exc:  # DeepSpeed launcher without deepspeed installed
        if "deepspeed" in str(exc).lower():
            _fail(
                "this accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED, the zero*.yaml configs) "
                "but deepspeed is not installed: pip install deepspeed, or use accelerate_configs/fsdp2.yaml "
                "(FSDP2 shards like ZeRO-3)",
                2,
            )
        raise


if __name__ == "__main__":
    main()
