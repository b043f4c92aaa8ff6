"""Plain data parallelism, all of it Accelerate's: single, DDP, FSDP2, ZeRO-1/2/3 (+ offload).

    backend = AccelerateBackend(accelerator, ctx, "zero3", args); backend.prepare(model)

Accelerate wraps, reduces, shards, clips and saves (save_state); hfpar adds nothing per rank.
"""

from __future__ import annotations

from hfpar.optim import build_optimizer

from .base import Backend, accelerate_clip


class AccelerateBackend(Backend):
    name = "accelerate"
    short = "Accelerate"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps_in_backward = self.strategy.startswith("zero")

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        # ZeRO partitions are tied to the world size that wrote them; DDP states are full, FSDP2's are DCP
        # (resharded on load)
        return strategy.startswith("zero")

    @classmethod
    def check(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        if args.on_nonfinite == "skip" and strategy.startswith("zero"):
            return [f"--on_nonfinite skip with {strategy}: DeepSpeed steps its optimizer inside backward, so a step "
                    "cannot be skipped; use --on_nonfinite error (stops at the bad step)"]
        return []

    def prepare(self, model) -> None:
        self.base_optimizer = build_optimizer(model, self.args)
        self.model, self.optimizer = self.acc.prepare(model, self.base_optimizer)

    def clip(self, max_norm: float) -> float:
        return accelerate_clip(self.acc, self.model, max_norm)
