"""The interface every composition backend implements, and the model-parallel base they share.

    backend = select_backend(strategy, parallelisms)(accelerator, ctx, strategy, args)   # hfpar.backends: SUPPORT picks the class
    backend.prepare(model)                                     # wrap + optimizer (backend.model, backend.optimizer)
    ... acc.backward(loss) ...; norm = backend.clip(max_norm); backend.step(lr); backend.zero_grad()
    backend.save_rank_state(ckpt_dir) / backend.load_rank_state(ckpt_dir); backend.full_state_dict()
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from hfpar.checkpoint import checkpointer as ckpt
from hfpar.config import ConfigError
from hfpar.train.optim import build_optimizer
from hfpar.parallel.expert_parallel import set_aux_loss_loss_scale
from hfpar.parallel.sharding import clip_grads_, full_state_dict, reduce_dp_grads, shard_spec, sync_partial_grads

from .loss_scale import found_inf, fp16_scaler, loss_scale, step_, unscale_


class Backend:
    """One composition of data parallelism with hfpar's model parallelism."""

    name = "base"
    steps_in_backward = False       # DeepSpeed: the optimizer steps inside the last micro-batch's backward

    def __init__(self, accelerator, ctx, strategy: str, args):
        self.acc, self.ctx, self.strategy, self.args = accelerator, ctx, strategy, args
        self.model = self.optimizer = self.base_optimizer = None

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        """Its checkpoints resume on the world size that wrote them only."""
        return False

    @classmethod
    def check(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        """Problems specific to this backend (before any model is loaded); one line each."""
        return []

    def prepare(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def autocast(self):
        return contextlib.nullcontext()  # Accelerate's prepare() already wraps forward in autocast

    def forward_loss(self, batch: dict, loss_fn, task: str = "lm"):
        """(loss sum, target count, logits) of one batch through the whole model."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        extra = {"use_cache": False} if task == "lm" else {}
        scope = getattr(loss_fn, "scope", None)  # a chunked LM loss: the head computes it in the forward
        with self.autocast(), (scope(batch["labels"]) if scope else contextlib.nullcontext()):
            logits = self.model(**inputs, **extra).logits
        loss_sum, n = loss_fn(logits, batch["labels"])
        return loss_sum, n, logits

    def loss_scale(self) -> float:
        """fp16: the loss scale this step's backward multiplies by (Accelerate's GradScaler on a GPU); else 1."""
        if self.steps_in_backward and self.model is not None:  # DeepSpeed scales inside its own backward
            return float(getattr(getattr(self.model, "optimizer", None), "loss_scale", 1.0) or 1.0)
        return loss_scale(getattr(self.acc, "scaler", None))

    def overflowed(self, grad_norm: float) -> bool:
        """fp16: the grads overflowed (the scaler skips this step and lowers its scale), not a bad step. The norm
        is the global one here (grads reduced before it), so every rank answers the same. DeepSpeed fp16: its
        loss scaler already skipped the step inside backward (its overflow check is all-reduced over dp)."""
        if self.steps_in_backward:
            engine = self.model
            return bool(engine.fp16_enabled()) and not engine.was_step_applied()
        return getattr(self.acc, "scaler", None) is not None and not math.isfinite(grad_norm)

    def train_micro(self, batch: dict, scope, loss_fn, scale: float, task: str = "lm") -> torch.Tensor:
        """Forward and backward of one accumulation step's rows; back-propagates loss_sum * scale (scale: dp x cp /
        the global target count, which the dp average and Accelerate's 1/accum turn into d(global mean)). Returns
        the detached loss sum."""
        # the MoE aux-loss gradient is injected in backward, past the fp16 loss scaling: scale it the same way
        set_aux_loss_loss_scale(self.loss_scale())
        with self.acc.accumulate(self.model), scope:
            loss_sum, _, _ = self.forward_loss(batch, loss_fn, task)
            self.acc.backward(loss_sum * (scale * self.args.gradient_accumulation_steps))  # Accelerate divides by accum
        return loss_sum.detach()

    def eval_loss(self, batch: dict, scope, loss_fn, task: str = "lm"):
        with scope:
            return self.forward_loss(batch, loss_fn, task)

    def clip(self, max_norm: float) -> float:
        raise NotImplementedError

    def step(self, lr: float) -> None:  # noqa: ARG002  (lr: for optimizers the scheduler does not drive)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def unwrapped(self) -> torch.nn.Module:
        return self.model.module if hasattr(self.model, "module") else self.model

    def hf_model(self) -> torch.nn.Module | None:
        """The model whose save_pretrained writes the export (None: Accelerate's unwrapped model)."""
        return None

    def save_rank_state(self, ckpt_dir: Path) -> None:
        """State Accelerate's save_state does not hold (per-rank shards); collective-free."""

    def load_rank_state(self, ckpt_dir: Path) -> None:
        pass

    def full_state_dict(self) -> dict | None:
        """Collective: full tensors under HF names, or None to let Accelerate gather (get_state_dict)."""
        return None

    def extra_state_bytes(self) -> int:
        """Optimizer-state bytes held outside self.optimizer (run_info.json)."""
        return 0


def accelerate_clip(accelerator, model, max_norm: float) -> float:
    """Accelerate's clip: DDP / FSDP2 (DTensor) norms, or DeepSpeed's own (which already clipped in its step)."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if norm is None:
        return float("nan")
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def hfpar_reduced(p: torch.Tensor) -> bool:
    """Parameters whose data-parallel grad reduction hfpar does itself (experts: ranks hold different ones)."""
    spec = shard_spec(p)
    return spec is not None and spec.dp_by_hfpar


class ModelParallelBackend(Backend):
    """Base of the backends where hfpar wraps the model (TP / EP over DDP or FSDP2): Accelerate's wrappers
    would reduce over the whole world and average different shards together. Grads: the partial ones
    summed over their group, experts reduced over the ranks holding them, then one global norm."""

    scaler = None  # fp16 on a GPU: Accelerate's GradScaler, its overflow flag made the world's (loss_scale.py)

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        return True  # per-rank shards

    def autocast(self):
        return self.acc.autocast()  # the model is not prepared by Accelerate

    def prepare(self, model: torch.nn.Module) -> None:
        model.to(self.acc.device)
        self.model = self.wrap(model)  # before the optimizer: FSDP2 replaces the parameters
        self.optimizer = self.base_optimizer = build_optimizer(self.model, self.args)
        self.scaler = fp16_scaler(self.acc)  # fp16: the optimizer is ours, so unscaling and skipping are too

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def clip(self, max_norm: float) -> float:
        params = list(self.model.parameters())
        sync_partial_grads(params)
        reduce_dp_grads(params)
        unscale_(self.scaler, self.optimizer)  # clip and log the true norm (sums and means commute with 1/scale)
        return float(clip_grads_(params, max_norm))

    def overflowed(self, grad_norm: float) -> bool:  # noqa: ARG002
        return found_inf(self.scaler, self.optimizer)  # the world's flag, which decides the skip on every rank

    def step(self, lr: float) -> None:  # noqa: ARG002
        step_(self.scaler, self.optimizer)

    def full_state_dict(self) -> dict:
        return full_state_dict(self.unwrapped())

    def _rank_file(self, ckpt_dir: Path) -> tuple[Path, bool]:
        """(file, whether this rank writes it): per rank when ranks of a replica hold different shards (FSDP2,
        experts); else one file per TP rank, written by dp rank 0 (the other dp ranks hold identical replicas)."""
        if self.strategy == "fsdp2" or any(hfpar_reduced(p) for p in self.model.parameters()):
            return ckpt.rank_state_file(ckpt_dir, self.ctx), True
        return ckpt.tp_state_file(ckpt_dir, self.ctx), self.ctx.dp_rank == 0

    def save_rank_state(self, ckpt_dir: Path) -> None:
        f, writes = self._rank_file(ckpt_dir)
        if writes:
            torch.save({"model": ckpt.local_state(self.model.state_dict()),
                        "optimizer": ckpt.local_state(self.optimizer.state_dict())}, f)

    def load_rank_state(self, ckpt_dir: Path) -> None:
        f, _ = self._rank_file(ckpt_dir)
        if not f.is_file():
            raise ConfigError(f"checkpoint {ckpt_dir} has no {f.name}: it was written with another world size / --tp_size")
        state = torch.load(f, map_location=self.acc.device, weights_only=False)
        with torch.no_grad():
            ckpt.load_local_state(self.model.state_dict(), state["model"])
        ckpt.load_optimizer_state(self.optimizer, state["optimizer"])
