"""The interface every composition backend implements (no strategy's specifics: those are the subclasses', the
strategy table's (strategies.py) and the data-parallel wrap components' (wraps.py)).

    backend = select_backend(strategy, parallelisms)(accelerator, ctx, strategy, args)   # hfpar.backends: SUPPORT
    picks the class
    backend.prepare(model)                                     # wrap + optimizer (backend.model, backend.optimizer)
    ... acc.backward(loss) ...; norm = backend.clip(max_norm); backend.step(lr); backend.zero_grad()
    backend.save_rank_state(ckpt_dir) / backend.load_rank_state(ckpt_dir); backend.full_state_dict()
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from hfpar.parallel.expert_parallel import set_aux_loss_loss_scale
from hfpar.parallel.sharding import shard_spec

from .loss_scale import loss_scale
from .reshard import load_full_state, resume_mode
from .strategies import STRATEGY


class Backend:
    """One composition of data parallelism with hfpar's model parallelism."""

    name = "base"
    steps_in_backward = False  # the optimizer steps inside the last micro-batch's backward (zero.EngineSteps)

    def __init__(self, accelerator, ctx, strategy, args, run_plan=None):
        """strategy: a Strategy of the table (ctx.strategy) or its name; run_plan: the preflight's RunPlan
        (hfpar.context), None outside a recipe run."""
        self.acc, self.ctx, self.args, self.run_plan = accelerator, ctx, args, run_plan
        self.spec = STRATEGY.get(str(strategy))  # what the strategy is (strategies.py); None: not in the table
        self.strategy = str(strategy)  # its name: run_info.json, trainer_state.json, messages
        self.model = self.optimizer = self.base_optimizer = None

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        """Its checkpoints resume on the world size that wrote them only."""
        return False

    @classmethod
    def loads_full_state(cls, strategy: str) -> bool:
        """It can resume from the full form of a checkpoint written on another mesh (load_full_state)."""
        return False

    def writes_full_state(self) -> bool:
        """Its checkpoints can be read into the full form (hfpar.checkpoint.full_state): "reshardable"."""
        return False

    def hf_name(self, key: str) -> str:
        """A state-dict name of self.model (or of the unwrapped model) -> the HF parameter name."""
        return key.removeprefix("module.")

    def resume_mode(self, state: dict, chunks: int) -> str | None:
        """How checkpoint `state` (its trainer_state.json) resumes here: "native" or "reshard" (the preflight refused
        the rest)."""
        return resume_mode(type(self), state, self.ctx, chunks)[0]

    def load_full_state(self, full) -> None:
        """Every rank: model and optimizer state set to its pieces of the full tensors (resume on another mesh)."""
        load_full_state(self.unwrapped(), self.base_optimizer, full, self.hf_name)

    @classmethod
    def check(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        """Problems of these options with this backend (before any model is loaded); one line each: the refusals
        every backend shares, then its own (problems)."""
        p = []
        if args.on_nonfinite == "skip" and cls.optimizer_steps_in_backward(strategy):
            p.append(
                f"--on_nonfinite skip with {strategy}: DeepSpeed steps its optimizer inside backward, before "
                "the trainer sees the grad norm, so a step cannot be skipped; use --on_nonfinite error (stops "
                "at the bad step)"
            )
        return p + cls.problems(args, ctx, strategy, mixed_precision)

    @classmethod
    def problems(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:  # noqa: ARG003
        """This backend's own problems with these options; one line each."""
        return []

    @classmethod
    def optimizer_steps_in_backward(cls, strategy: str) -> bool:  # noqa: ARG003
        """Whether the optimizer steps inside the last micro-batch's backward under `strategy` (a DeepSpeed engine)."""
        return cls.steps_in_backward

    def prepare(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def autocast(self):
        return contextlib.nullcontext()  # Accelerate's prepare() already wraps forward in autocast

    def forward_loss(self, batch: dict, loss_fn, task: str = "lm"):
        """(loss sum, target count, logits) of one batch through the whole model."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        extra = {"use_cache": False} if task == "lm" else {}
        scope = getattr(loss_fn, "scope", None)  # a chunked LM loss: the head computes it in the forward
        with self.autocast(), scope(batch["labels"]) if scope else contextlib.nullcontext():
            logits = self.model(**inputs, **extra).logits
        loss_sum, n = loss_fn(logits, batch["labels"])
        return loss_sum, n, logits

    def loss_scale(self) -> float:
        """fp16: the loss scale this step's backward multiplies by (Accelerate's GradScaler on a GPU); else 1."""
        return loss_scale(getattr(self.acc, "scaler", None))

    def overflowed(self, grad_norm: float) -> bool:
        """fp16: the grads overflowed (the scaler skips this step and lowers its scale), not a bad step. The norm
        is the global one here (grads reduced before it), so every rank answers the same."""
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

    def other_optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state held by optimizers other than self.optimizer (run_info.json), e.g. the experts' one
        beside ZeRO."""
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
