"""Model parallelism (TP, EP) over DeepSpeed ZeRO-1/2, through Accelerate's DeepSpeed path.

    backend = ModelParallelDeepSpeed(accelerator, ctx, "zero2", args); backend.prepare(model)

TP: DeepSpeed gets a "model parallel unit" (hfpar.backends.zero.DeepSpeedMPU) naming the dp and TP groups, so ZeRO
partitions and reduces over dp only and its grad norm sums the TP shards (tagged tensor_model_parallel by
their ShardSpec) over TP. Partial grads (SP norms) are summed over TP by backward hooks:
ZeRO takes grads inside backward.

EP: DeepSpeed's own MoE support is tied to its `deepspeed.moe.layer.MoE` module (found by type, expert keys
renamed in its checkpoints, expert grad norms averaged per EP rank, which is not the one-process norm).
So ZeRO partitions the dense parameters only and hfpar keeps the experts (different on every EP rank):
  - DeepSpeed broadcasts every module parameter from rank 0 at initialize: the experts are put back;
  - their grads are reduced over the expert-data-parallel group and their squared norm joins DeepSpeed's
    dense norm inside its step (a wrapper on the ZeRO optimizer's `scaled_global_norm`; bf16 + ZeRO-1 runs
    DeepSpeed's BF16_Optimizer instead: one more tensor in its `get_grads_for_norm`), so DeepSpeed
    clips the dense grads, and hfpar the experts, by the one global norm;
  - an AdamW of their own (fp32 master copies when DeepSpeed cast the model to bf16) at the scheduler's lr,
    saved per rank in the checkpoint (DeepSpeed's holds rank 0's experts only).
That part is the ExpertsBesideZeRO mixin, which the pipeline's ZeRO-1 backend (pipeline_zero.py) holds as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpar.checkpoint.layout import rank_state_file
from hfpar.config import ConfigError
from hfpar.parallel.guard import release
from hfpar.parallel.sharding import (
    full_state_dict,
    grad_sq_norm,
    partial_grad_hooks,
    reduce_dp_grads,
    scale_grads_to_norm_,
)

from .base import Backend, accelerate_clip, hfpar_reduced
from .optim import build_optimizer
from .zero import DeepSpeedMPU, EngineSteps, deepspeed_with_mpu


class ExpertsBesideZeRO:
    """Mixin of the ZeRO-1/2 backends (ModelParallelDeepSpeed, PipelineZeRO1): the experts (hfpar_reduced, different
    on the ranks of DeepSpeed's dp group) kept out of DeepSpeed's optimizer, reduced over their expert-dp group,
    clipped by the one global norm DeepSpeed's step computes with them and stepped by an AdamW of their own.

        experts, saved = self._take_experts(model)        # before acc.prepare: the optimizer skips them
        ... acc.prepare under hfpar's mpu ...; self._setup_experts(experts, saved)
    """

    experts: tuple | list = ()  # none until _setup_experts
    frozen_experts: tuple | list = ()  # LoRA's: restored after DeepSpeed's broadcast and load, gathered at export
    expert_norm_group = None  # a group the experts' squared norm is also summed over (the pipeline's stages)

    def _take_experts(self, model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the experts, copies of them): DeepSpeed broadcasts every module parameter from dp rank 0 at initialize."""
        experts = [p for p in model.parameters() if hfpar_reduced(p)]
        return experts, [p.detach().clone() for p in experts]

    def _setup_experts(self, experts: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
        with torch.no_grad():  # frozen experts too (LoRA): restored after the broadcast, never stepped
            for p, s in zip(experts, saved):
                p.copy_(s)
        trained = [(p, s) for p, s in zip(experts, saved) if p.requires_grad]
        self.experts = [p for p, _ in trained]
        self.frozen_experts = [p for p in experts if not p.requires_grad]
        if not self.experts:
            return
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(s.to(p.device, torch.float32)) for p, s in trained
        ]
        self.expert_optimizer = build_optimizer(self.masters, self.args)
        zopt = self.model.optimizer  # DeepSpeedZeroOptimizer (stage 1 or 2), or BF16_Optimizer (bf16 + stage 1)
        if getattr(zopt, "compute_grad_norm", True) and hasattr(zopt, "scaled_global_norm"):
            self._join_zero_norm(zopt)
        elif hasattr(zopt, "get_grads_for_norm"):
            self._join_bf16_norm(zopt)
        else:
            raise ConfigError(
                f"--ep_size with {self.strategy}: DeepSpeed's {type(zopt).__name__} computes no "
                "global grad norm hfpar can join the experts to; use fp32 or bf16 with zero2"
            )

    def _join_zero_norm(self, zopt) -> None:
        """DeepSpeedZeroOptimizer: its global norm (of the dense partitions, summed over dp) wrapped."""
        dense_norm = zopt.scaled_global_norm

        def norm_with_experts(*a, **kw):
            dense = torch.as_tensor(dense_norm(*a, **kw), device=self.acc.device)
            self._total_norm = (dense.double().square() + self._expert_sq_norm()).sqrt()
            return self._total_norm.to(dense.dtype)

        zopt.scaled_global_norm = norm_with_experts

    def _join_bf16_norm(self, zopt) -> None:
        """BF16_Optimizer (bf16 + ZeRO-1): it has no norm method to wrap; its step takes the norm of the tensors
        get_grads_for_norm lists (every rank's full fp32 dense grads, summed over TP through the mpu). The experts
        join as one more tensor holding their global norm, listed on TP rank 0 only (the mpu sum would count it
        tp times); DeepSpeed then clips the dense grads by the joint norm, and records it for
        engine.get_global_grad_norm(), by which clip() scales the experts."""
        dense_grads = zopt.get_grads_for_norm

        def grads_with_experts(for_clipping=False):
            out = dense_grads(for_clipping=for_clipping)
            if for_clipping:  # the tensors to scale: the dense ones (hfpar scales the experts)
                return out
            non_expert, expert = out
            sq = self._expert_sq_norm()
            if self.ctx.tp_rank == 0:
                non_expert = [*non_expert, sq.sqrt().float().reshape(1)]
            return non_expert, expert

        zopt.get_grads_for_norm = grads_with_experts
        self._total_norm = None  # read from the engine after its step

    def _expert_sq_norm(self) -> torch.Tensor:
        """Collective: the experts' grads reduced over their expert-dp groups, their global squared norm (float64)."""
        reduce_dp_grads(self.experts)
        sq = grad_sq_norm(self.experts, self.acc.device)
        if self.expert_norm_group is not None:
            dist.all_reduce(sq, group=self.expert_norm_group)
        return sq

    def _clip_experts(self, max_norm: float) -> torch.Tensor:
        """The experts clipped by the global norm DeepSpeed's step computed with them (float64), which it returns."""
        total = self._total_norm
        if total is None:  # BF16_Optimizer: the joint norm its step computed
            total = torch.tensor(float(self.model.get_global_grad_norm()), dtype=torch.float64, device=self.acc.device)
        for p, m in zip(self.experts, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        scale_grads_to_norm_(self.masters, total, max_norm)
        return total

    def _step_experts(self, lr: float) -> None:
        if not self.experts:
            return
        for group in self.expert_optimizer.param_groups:  # the lr DeepSpeed's optimizer used for this step
            group["lr"] = lr
        self.expert_optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.experts, self.masters):
                if m is not p:
                    p.copy_(m)

    def _zero_expert_grads(self) -> None:
        for p in self.experts:
            p.grad = None
        if self.experts:
            self.expert_optimizer.zero_grad(set_to_none=True)

    def other_optimizer_state_bytes(self) -> int:
        if not self.experts:
            return 0
        # here, not at the top: hfpar.observe.metrics imports `datasets` (0.6 s of `hfpar plan`'s start-up, measured
        # with -X importtime; the planner reads the strategy table of this package and never reaches this line)
        from hfpar.observe.metrics import optimizer_state_bytes  # noqa: PLC0415

        return optimizer_state_bytes(self.expert_optimizer) + sum(
            m.numel() * m.element_size() for p, m in zip(self.experts, self.masters) if m is not p
        )

    def save_rank_state(self, ckpt_dir) -> None:
        if not self.experts and not self.frozen_experts:
            return
        state = {"frozen_experts": [p.detach() for p in self.frozen_experts]}  # DeepSpeed's holds rank 0's experts only
        if self.experts:
            state.update(
                experts=[p.detach() for p in self.experts],
                masters=[m.detach() for m in self.masters],
                optimizer=self.expert_optimizer.state_dict(),
            )
        torch.save(state, rank_state_file(ckpt_dir, self.ctx))

    def load_rank_state(self, ckpt_dir) -> None:
        if not self.experts and not self.frozen_experts:
            return
        f = rank_state_file(ckpt_dir, self.ctx)
        if not f.is_file():
            raise ConfigError(
                f"checkpoint {ckpt_dir} has no {f.name}: it was written with another world size / --ep_size"
            )
        state = torch.load(f, map_location=self.acc.device, weights_only=True)  # tensors and plain values only
        with torch.no_grad():  # after DeepSpeed's load, which put rank 0's experts everywhere
            for p, t in zip(self.frozen_experts, state.get("frozen_experts", []), strict=True):
                p.copy_(t)
        if not self.experts:
            return
        with torch.no_grad():
            for p, t in zip(self.experts, state["experts"]):
                p.copy_(t)
            for m, t in zip(self.masters, state["masters"]):
                m.copy_(t)
        self.expert_optimizer.load_state_dict(state["optimizer"])


class ModelParallelDeepSpeed(ExpertsBesideZeRO, EngineSteps, Backend):
    name = "model-parallel over DeepSpeed ZeRO-1/2"
    short = "hfpar + DeepSpeed"

    @classmethod
    def resume_needs_same_world(cls, strategy: str) -> bool:
        return True

    @classmethod
    def problems(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        p = []
        if ctx.ep > 1 and mixed_precision == "fp16":
            p.append(
                f"--ep_size {ctx.ep} with {strategy} and fp16: the experts' optimizer does not unscale "
                "DeepSpeed's fp16 loss scale; use bf16 or fp32"
            )
        elif mixed_precision == "fp16":  # TP / CP with TP: DeepSpeed's own loss scale, with hfpar's mpu not verified
            flags = " and ".join(f"--{k}_size {getattr(ctx, k)}" for k in ("tp", "cp") if getattr(ctx, k) > 1)
            p.append(
                f"{flags} with {strategy} and fp16: DeepSpeed's fp16 loss scaling is not verified with hfpar's "
                "model parallelism; use bf16 (or ddp.yaml / fsdp2.yaml, where hfpar unscales fp16 itself)"
            )
        return p

    def prepare(self, model) -> None:
        experts, saved = self._take_experts(model)
        self.base_optimizer = build_optimizer(model, self.args, skip=frozenset(id(p) for p in experts))
        partial_grad_hooks(model.parameters())  # a no-op without partial grads
        mpu = DeepSpeedMPU(self.ctx.tp_group, self.ctx.replica_group) if self.ctx.tp > 1 else None
        release(model)  # the refusal apply_* armed (hfpar.parallel.guard): this DeepSpeed wrap spans the dp group only
        with deepspeed_with_mpu(mpu):
            self.model, self.optimizer = self.acc.prepare(model, self.base_optimizer)
        self._setup_experts(experts, saved)

    def clip(self, max_norm: float) -> float:
        """DeepSpeed has clipped and stepped (inside backward) with the global norm: clip the experts by it."""
        if not self.experts:
            return accelerate_clip(self.acc, self.model, max_norm)
        return float(self._clip_experts(max_norm))

    def step(self, lr: float) -> None:
        self.optimizer.step()  # a no-op: DeepSpeed stepped in backward
        self._step_experts(lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._zero_expert_grads()

    def full_state_dict(self) -> dict | None:
        if self.ctx.tp == 1 and not self.experts and not self.frozen_experts:
            return None
        return full_state_dict(self.unwrapped(), base=self.acc.get_state_dict(self.model))
