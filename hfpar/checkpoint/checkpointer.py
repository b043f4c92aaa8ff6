"""The Checkpointer: everything a run writes to or reads from its checkpoints, called by the trainer.

    ckpt = Checkpointer(accelerator, ctx, backend, "out", total_steps=100, save_steps=20, save_total_limit=2,
                        resume="latest", seed=42, global_batch=32, pp_virtual_stages=1, tokenizer=tokenizer)
    ckpt.register(scheduler)            # saved with each checkpoint as scheduler.json
    start = ckpt.resume()               # 0 (fresh run) or the step of the checkpoint loaded
    if ckpt.should_save(step): ckpt.save(step)
    ckpt.watch_signals("TERM,USR1")     # preemption: a flag set by the handler ...
    if ckpt.preempted(): ckpt.save(step); raise Preempted(step)   # ... agreed by every rank at a step boundary
    ckpt.export_final()                 # the HF-format model at the output dir's root (final_model.py)

The layout of checkpoint-<step>/ is defined in layout.py. One place writes a checkpoint (save_checkpoint, write.py) and
one reads it (Checkpointer.load); the backend's save_rank_state / load_rank_state hooks hold the per-rank files.

Crash safety: a checkpoint is written to `.checkpoint-<step>.tmp/`, its files fsynced, its manifest (every file's
size and hash, manifest.py) written after them, then renamed to `checkpoint-<step>/` and marked COMPLETE. `latest`
only ever picks a COMPLETE checkpoint that verifies, so a kill during a save, or a file damaged later, leaves the
previous one usable. Retention (--save_total_limit) only deletes older COMPLETE checkpoints written by hfpar and
never the newest one that verifies.

No code runs on load: every read happens inside safe_load.safe_loading() (torch.load with weights_only=True, DCP's
metadata through a restricted unpickler), the scheduler is JSON and the RNG states safetensors (rank_state.py), and
Accelerate's pickled random_states_<rank>.pkl is not kept.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from hfpar.checkpoint import final_model
from hfpar.checkpoint.full_state import read_full_state
from hfpar.checkpoint.layout import RESUME_KEYS, read_trainer_state, resolve_resume
from hfpar.checkpoint.rank_state import load_rng, rng_accelerate_step, save_rng
from hfpar.checkpoint.safe_load import CheckpointError, check_dcp_metadata, safe_loading
from hfpar.checkpoint.write import (  # apply_retention, DiskFullError: re-exported (they lived here before write.py)
    DiskFullError,  # noqa: F401
    _save_wrapped_config,
    apply_retention,  # noqa: F401
    load_checkpoint,
    save_checkpoint,
)
from hfpar.distributed import all_reduce_sum, restart_attempt

SCHEDULER_FILE = "scheduler.json"
OBJECTIVE_FILE = "objective_state.safetensors"  # the objective's own state (a rollout buffer), if any
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later"; the recipe exits with it after a preemption checkpoint


class Preempted(Exception):
    """A preemption signal arrived: every rank saved checkpoint-<step> and the run stops (exit PREEMPTED_EXIT)."""

    def __init__(self, step: int, signame: str):
        super().__init__(
            f"{signame} received: saved checkpoint-{step}, exiting with code {PREEMPTED_EXIT}; relaunch "
            "with --resume_from_checkpoint latest to continue"
        )
        self.step = step


class Checkpointer:
    """Layout, trainer state, cadence, retention, resume and final export of one run. Collective methods (save,
    resume, export_final) are called by every rank."""

    def __init__(
        self,
        accelerator: Accelerator,
        ctx,
        backend,
        output_dir: str,
        *,
        total_steps: int,
        save_steps: int,
        save_total_limit: int | None,
        resume: str | None,
        seed: int,
        global_batch: int,
        pp_virtual_stages: int,
        tokenizer=None,
        peft: bool = False,
        merge_adapter: bool = False,
        identity: dict | None = None,
    ):
        self.acc, self.ctx, self.backend, self.output_dir = accelerator, ctx, backend, output_dir
        self.total_steps, self.save_steps, self.save_total_limit = total_steps, save_steps, save_total_limit
        self.resume_from, self.seed, self.global_batch = resume, seed, global_batch
        self.pp_virtual_stages = pp_virtual_stages  # model chunks per pipeline rank
        self.tokenizer, self.peft, self.merge_adapter = tokenizer, peft, merge_adapter
        self.scheduler = None
        self.objective = None  # an Objective whose state_dict() a checkpoint keeps (register)
        self.identity = identity  # layout.run_identity: `latest` refuses another run's checkpoint
        self.signal_received: str | None = None

    def register(self, scheduler, objective=None) -> None:
        """The LR scheduler, saved as scheduler.json (its state dict is numbers and lists), and the objective's own
        state (objective.state_dict(): tensors, as safetensors). Neither is registered with Accelerate, which would
        pickle them to custom_checkpoint_<i>.pkl and read that back with weights_only=False."""
        self.scheduler = scheduler
        self.objective = objective

    def trainer_state(self, step: int) -> dict:
        """trainer_state.json: what the preflight checks a resume against, before any weight is read."""
        c = self.ctx
        return {
            "global_step": step,
            "world_size": c.world,
            "dp": c.dp,
            "tp": c.tp,
            "ep": c.ep,
            "cp": c.cp,
            "pp": c.pp,
            "pp_virtual_stages": self.pp_virtual_stages,
            "strategy": self.backend.strategy,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "peft": self.peft,
            # its full form can be read on another mesh (full_state.py): resume there, export
            "reshardable": self.backend.writes_full_state() and not self.peft,
            **({"identity": self.identity} if self.identity is not None else {}),
        }

    def watch_signals(self, names: str) -> None:
        """Preemption: on each signal named ("TERM,USR1"), only a flag is set; the trainer asks preempted() at
        every step boundary. Signal handlers can only be installed from the main thread (else: left alone)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in filter(None, (x.strip().upper().removeprefix("SIG") for x in names.split(","))):
            signal.signal(getattr(signal, f"SIG{name}"), self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.signal_received = signal.Signals(signum).name

    def preempted(self) -> bool:
        """Collective, at a step boundary: whether any rank received a preemption signal (ranks get it at
        different moments: a sum over the world makes them all stop at the same step)."""
        return bool(all_reduce_sum(1 if self.signal_received else 0, self.acc.device) > 0)

    def stop_for_preemption(self, step: int, saved: bool) -> None:
        """Collective: checkpoint-<step> (unless this step's was just written), then Preempted."""
        if not saved:
            self.save(step)
        raise Preempted(step, self.signal_received or "a preemption signal on another rank")

    def should_save(self, step: int) -> bool:
        """Every --save_steps optimizer steps, and at the last step (when saving at all)."""
        return bool(self.save_steps) and (step % self.save_steps == 0 or step == self.total_steps)

    def save(self, step: int) -> Path:
        """Collective: checkpoint-<step>/, then retention."""
        return save_checkpoint(
            self.acc,
            self.output_dir,
            step,
            self.trainer_state(step),
            self.save_total_limit,
            extra=self._save_extra,
            tokenizer=self.tokenizer,
        )

    def _save_extra(self, tmp: Path) -> None:
        """Every rank: the backend's per-rank files, this rank's RNG; the main process: scheduler.json."""
        self.backend.save_rank_state(tmp)
        save_rng(tmp, self.acc.process_index, int(getattr(self.acc, "step", 0)))
        if self.acc.is_main_process and self.scheduler is not None:
            (tmp / SCHEDULER_FILE).write_text(json.dumps(self.scheduler.state_dict()))
        state = self.objective.state_dict() if self.objective is not None else {}
        if self.acc.is_main_process and state:
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, tmp / OBJECTIVE_FILE)
        if self.acc.is_main_process and not self.acc._models and not self.peft:
            _save_wrapped_config(self.backend.unwrapped(), tmp)

    def resume(self) -> int:
        """Collective. The step to start from: that of the checkpoint --resume_from_checkpoint names (latest|PATH),
        loaded here, or 0. Compatibility was checked by the preflight, before the model was loaded."""
        path = resolve_resume(self.resume_from, self.output_dir)
        if path is None:
            if self.resume_from:
                self.acc.print(
                    f"[hfpar] --resume_from_checkpoint {self.resume_from}: no checkpoint yet, starting fresh"
                )
            return 0
        step = self.load(path)["global_step"]
        attempt = restart_attempt()
        self.acc.print(
            f"[hfpar] resumed from {path} at step {step}"
            + (f" (torchrun restart attempt {attempt})" if attempt else "")
        )
        return step

    def load(self, path: Path) -> dict:
        """Collective: the one place a checkpoint is read back (Accelerate's state, then the backend's per-rank
        files); returns its trainer state."""
        check_dcp_metadata(path)
        if self.backend.resume_mode(read_trainer_state(path, RESUME_KEYS), self.pp_virtual_stages) == "reshard":
            return self._load_resharded(path)
        with safe_loading(path):
            state = load_checkpoint(self.acc, path)
            self.backend.load_rank_state(path)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(json.loads((path / SCHEDULER_FILE).read_text()))
        self._load_objective(path)
        if state.get("world_size") != self.ctx.world:  # another world size (DDP / FSDP2): other RNG streams anyway
            self.acc.print(
                f"[hfpar] {path} was written by {state.get('world_size')} processes, this run has "
                f"{self.ctx.world}: the random generators start from --seed, not from the checkpoint"
            )
            return state
        try:
            self.acc.step = load_rng(path, self.acc.process_index)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{path}: rank {self.acc.process_index}'s RNG state unreadable ({exc}); the resume would not be exact"
            ) from None
        return state

    def _load_objective(self, path: Path) -> None:
        """The objective's state from the checkpoint (safetensors: tensors only), if it keeps one."""
        f = path / OBJECTIVE_FILE
        if self.objective is not None and f.is_file():
            self.objective.load_state_dict(load_file(f, device="cpu"))

    def _load_resharded(self, path: Path) -> dict:
        """Collective: a checkpoint of another mesh (the preflight accepted it): its full form read by every rank,
        each loading its own pieces through this run's layout; scheduler and data position exact. The RNG streams
        are per rank: with the same world size each rank's are restored, else they start from --seed (the tiny
        test models have no dropout: the training is then exact too)."""
        state = read_trainer_state(path)
        with safe_loading(path):
            full = read_full_state(path)
        self.backend.load_full_state(full)
        del full
        if self.scheduler is not None:
            self.scheduler.load_state_dict(json.loads((path / SCHEDULER_FILE).read_text()))
            for group, lr in zip(self.backend.base_optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr  # what optimizer.load_state_dict restores on the native path
        self._load_objective(path)
        same_world = state.get("world_size") == self.ctx.world
        self.acc.step = load_rng(path, self.acc.process_index) if same_world else rng_accelerate_step(path, 0)
        theirs = " ".join(f"{k} {state.get(k, 1)}" for k in ("dp", "tp", "ep", "cp", "pp"))
        self.acc.print(
            f"[hfpar] resharded {path} ({state.get('strategy')} x {state.get('world_size')}: {theirs}) onto "
            f"{self.backend.strategy} x {self.ctx.world}: model and optimizer state from full tensors"
            + ("" if same_world else "; random generators start from --seed (another world size)")
        )
        return state

    def export_final(self) -> None:
        """Collective: the final model in HF format at the output dir's root."""
        final_model.export_final(
            self.acc, self.backend, self.tokenizer, self.output_dir, peft=self.peft, merge_adapter=self.merge_adapter
        )
