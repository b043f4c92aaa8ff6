"""Model parallelism (TP, EP, CP with TP) where hfpar wraps the model: over DDP or FSDP2 on the dp (x cp) group.

    backend = ModelParallelFSDP2(accelerator, ctx, "fsdp2", args); backend.prepare(tp_model)

The data-parallel wrap (why: docs/architecture.md#why-backends-and-integrations) is a component (wraps.py) the
backend holds: TorchDDP for ModelParallelDDP, FullyShard for ModelParallelFSDP2; experts are left out of it
(sharded by EP already) and hfpar reduces their grads over the ranks holding the same ones. Grads: the
partial ones summed over their group, experts reduced, then one global norm.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hfpar.checkpoint.layout import rank_state_file, tp_state_file
from hfpar.checkpoint.rank_state import load_local_state, load_optimizer_state, local_state
from hfpar.config import ConfigError
from hfpar.parallel.sharding import clip_grads_, full_state_dict, reduce_dp_grads, sync_partial_grads

from .base import Backend, hfpar_reduced
from .loss_scale import found_inf, fp16_scaler, step_, unscale_
from .optim import build_optimizer
from .reshard import pieces_of_module
from .wraps import DataParallelWrap, FullyShard, TorchDDP


class ModelParallelBackend(Backend):
    """Base of the backends where hfpar wraps the model; `data_parallel` names the wrap component."""

    data_parallel: type[DataParallelWrap] | None = None
    scaler = None  # fp16 on a GPU: Accelerate's GradScaler, its overflow flag made the world's (loss_scale.py)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dp_wrap = self.data_parallel() if self.data_parallel is not None else None
        if self.dp_wrap is not None and self.run_plan is not None:
            self.dp_wrap.find_unused_parameters = self.run_plan.image_text

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        return True  # per-rank shards

    @classmethod
    def loads_full_state(cls, strategy: str) -> bool:
        return True

    def writes_full_state(self) -> bool:
        return True

    @classmethod
    def problems(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        return cls.data_parallel.check(args, ctx, strategy, mixed_precision) if cls.data_parallel else []

    def autocast(self):
        return self.acc.autocast()  # the model is not prepared by Accelerate

    def prepare(self, model: torch.nn.Module) -> None:
        model.to(self.acc.device)
        self.model = self.wrap(model)  # before the optimizer: FSDP2 replaces the parameters
        self.optimizer = self.base_optimizer = build_optimizer(self.model, self.args)
        self.scaler = fp16_scaler(self.acc)  # fp16: the optimizer is ours, so unscaling and skipping are too

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.dp_wrap.wrap(
            self.acc,
            self.ctx,
            model,
            layer_types=set(getattr(model, "_no_split_modules", None) or []),
            ignored=[p for p in model.parameters() if hfpar_reduced(p)],
        )

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
        if self.dp_wrap.per_rank_shards or any(hfpar_reduced(p) for p in self.model.parameters()):
            return rank_state_file(ckpt_dir, self.ctx), True
        return tp_state_file(ckpt_dir, self.ctx), self.ctx.dp_rank == 0

    def save_rank_state(self, ckpt_dir: Path) -> None:
        f, writes = self._rank_file(ckpt_dir)
        if writes:
            torch.save(
                {
                    "model": local_state(self.model.state_dict()),
                    "optimizer": local_state(self.optimizer.state_dict()),
                    **pieces_of_module(self.model, self.optimizer, self.hf_name),
                },
                f,
            )  # joined offline by it

    def load_rank_state(self, ckpt_dir: Path) -> None:
        f, _ = self._rank_file(ckpt_dir)
        if not f.is_file():
            raise ConfigError(
                f"checkpoint {ckpt_dir} has no {f.name}: it was written with another world size / --tp_size"
            )
        state = torch.load(f, map_location=self.acc.device, weights_only=True)  # tensors and plain values only
        with torch.no_grad():
            load_local_state(self.model.state_dict(), state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])


class ModelParallelDDP(ModelParallelBackend):
    name = "model-parallel over DDP"
    short = "hfpar DDP"
    data_parallel = TorchDDP


class ModelParallelFSDP2(ModelParallelBackend):
    name = "model-parallel over FSDP2"
    short = "hfpar FSDP2"
    data_parallel = FullyShard
