"""Plain data parallelism, all of it Accelerate's: single, DDP, FSDP2, ZeRO-1/2/3 (+ offload).

    backend = AccelerateBackend(accelerator, ctx, "zero3", args); backend.prepare(model)

Accelerate wraps, reduces, shards, clips and saves (save_state); hfpar adds nothing per rank. Under ZeRO the model
is DeepSpeed's engine, whose loss scale and skipped steps are read as every DeepSpeed backend reads them (zero.py).
"""

from __future__ import annotations

import json

from accelerate.utils import DistributedDataParallelKwargs, fsdp_utils
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hfpar import loading
from hfpar.distributed import swapped

from .base import Backend, accelerate_clip
from .optim import build_optimizer
from .reshard import load_full_state_zero
from .strategies import strategy_of
from .zero import EngineSteps


class AccelerateBackend(Backend):
    name = "accelerate"
    short = "Accelerate"

    def __init__(self, *a, checkpoint_index: dict | None = None, **kw):
        super().__init__(*a, **kw)
        self.checkpoint_index = checkpoint_index  # plain FSDP2 from a checkpoint: a meta model comes to prepare
        self.steps_in_backward = self.spec.deepspeed  # ZeRO: Accelerate's model is DeepSpeed's engine

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        # ZeRO partitions are tied to the world size that wrote them; DDP states are full, FSDP2's are DCP
        # (resharded on load)
        return strategy_of(strategy).deepspeed

    @classmethod
    def loads_full_state(cls, strategy: str) -> bool:
        spec = strategy_of(strategy)  # ZeRO-3's partitioned parameters: not yet (loaded through DeepSpeed's fragments)
        return spec.layout in ("accelerate", "fsdp2") or (spec.deepspeed and not spec.shards[0])

    def writes_full_state(self) -> bool:
        return self.spec.layout in ("accelerate", "fsdp2", "deepspeed")

    def load_full_state(self, full) -> None:
        if self.spec.deepspeed:
            load_full_state_zero(self.model, full)
        else:
            super().load_full_state(full)

    def save_rank_state(self, ckpt_dir) -> None:
        """The accelerate layout's optimizer.bin numbers its parameters: their HF names, in that order
        (full_state.OPTIMIZER_PARAMS), so that another mesh can match them."""
        if self.acc.is_main_process and self.spec.layout == "accelerate":
            names = {id(p): self.hf_name(n) for n, p in self.unwrapped().named_parameters(remove_duplicate=False)}
            order = [names[id(p)] for g in self.base_optimizer.param_groups for p in g["params"]]
            (ckpt_dir / "optimizer_params.json").write_text(json.dumps(order))

    @classmethod
    def optimizer_steps_in_backward(cls, strategy: str) -> bool:
        return strategy_of(strategy).deepspeed

    def loss_scale(self) -> float:
        return EngineSteps.loss_scale(self) if self.steps_in_backward else super().loss_scale()

    def overflowed(self, grad_norm: float) -> bool:
        return EngineSteps.overflowed(self, grad_norm) if self.steps_in_backward else super().overflowed(grad_norm)

    def prepare(self, model) -> None:
        if self.checkpoint_index is not None and any(p.is_meta for p in model.parameters()):
            self._prepare_meta_fsdp2(model)
            return
        self.base_optimizer = build_optimizer(model, self.args)
        _unwrap_subclass_params(self.base_optimizer)
        if self.run_plan is not None and self.run_plan.image_text:  # parameters without a gradient in some steps:
            # LLaVA's unused post_layernorm, the vision tower in a batch without images (TRL does the same for VLMs)
            self.acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        self.model, self.optimizer = self.acc.prepare(model, self.base_optimizer)

    def _prepare_meta_fsdp2(self, model) -> None:
        """Accelerate's cpu_ram_efficient_loading path (fully_shard on meta, then a sharded state dict assigned,
        non-persistent buffers re-registered, weights re-tied), with its rank-0 load + broadcast replaced by
        hfpar.loading.sharded's reader: every rank reads only its own dim-0 shards from the files."""
        plugin = self.acc.state.fsdp_plugin
        # Accelerate wants the optimizer prepared with the model, and maps its params to FSDP2's by data_ptr, which
        # is 0 for every meta tensor: its groups are rebuilt from the wrapped model (same order: same module tree)
        self.base_optimizer = build_optimizer(model, self.args)
        with (
            swapped(plugin, "cpu_ram_efficient_loading", True),
            swapped(fsdp_utils, "fsdp2_load_full_state_dict", loading.fsdp2_loader(self.checkpoint_index)),
        ):
            self.model, self.optimizer = self.acc.prepare(model, self.base_optimizer)
        real = build_optimizer(self.model, self.args)
        self.base_optimizer.param_groups[:] = real.param_groups
        self.base_optimizer.defaults = real.defaults

    def clip(self, max_norm: float) -> float:
        return accelerate_clip(self.acc, self.model, max_norm)


def _unwrap_subclass_params(optimizer) -> None:
    """Accelerate's FSDP2 prepare matches the optimizer's parameters to the sharded ones by data_ptr, which torchao's
    fp8 all-gather weight (mixed_precision fp8, tensorwise) reports as 0; Accelerate reads the wrapped tensor on the
    model's side (its `_tensor`), and in its own flow converts the model after the optimizer was built, so the
    optimizer holds that tensor: hfpar converts first (after TP) and gives the optimizer the wrapped tensor too
    (prepare replaces every entry with its sharded parameter)."""
    for group in optimizer.param_groups:
        group["params"] = [p._tensor if is_traceable_wrapper_subclass(p) else p for p in group["params"]]
