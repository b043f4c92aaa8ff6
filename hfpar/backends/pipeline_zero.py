"""Pipeline parallelism over DeepSpeed ZeRO-1: each stage's optimizer state partitioned over its dp group, with the
stage tensor-parallel (--tp_size), expert-parallel (--ep_size) and / or context-parallel (--cp_size) as it comes.

    backend = PipelineZeRO1(accelerator, ctx, "zero1", args); backend.prepare(stage)   # a PipelineStage

The schedule runs its backwards itself (several per step, in an order that differs between stages), so
DeepSpeed's engine never sees them: grads accumulate in the stage's parameters as with PipelineDDP, and at the
step the ZeRO-1 optimizer reduces them over the stage's dp group the way DeepSpeed's own PipelineEngine has it
do (`reduce_gradients(pipeline_parallel=True)`), then the engine takes its step with the boundary set by hand.

Groups: DeepSpeed gets a "model parallel unit" (zero.DeepSpeedMPU) whose data-parallel group is the stage's replica
group (dp x cp: ZeRO partitions and broadcasts there only) and whose model-parallel group joins the ranks of one
replica that hold different dense tensors: the stages x the TP ranks (ctx.rank_lists("pp", "tp")). DeepSpeed's grad
norm sums the squares of each parameter tagged `tensor_model_parallel` over that group and counts an untagged one on
its rank 0 only (the first stage's first TP rank), so each parameter is tagged by what it is: a TP shard on every
rank (summed over TP and the stages), a TP-replicated parameter on TP rank 0 only (summed over the stages, once), the
last stage's copy of a tied embedding never (the first stage counts it). DeepSpeed clips and steps with that norm.

Experts (EP, drawn from the dp x cp ranks: different on the ranks of DeepSpeed's dp group) stay out of DeepSpeed's
optimizer as under ZeRO-1/2 without a pipeline (mp_deepspeed.ExpertsBesideZeRO): reduced over their expert-dp group,
their squared norm summed over the stages and joined to DeepSpeed's inside its step, clipped by that one norm and
stepped by an AdamW of their own, saved per rank.

fp32 only (bf16 / fp16 refused in check(); why: docs/architecture.md#why-backends-and-integrations).
"""

from __future__ import annotations

from hfpar.parallel.groups import new_groups
from hfpar.parallel.sharding import sync_partial_grads

from .mp_deepspeed import ExpertsBesideZeRO
from .optim import build_optimizer
from .pipeline import PipelineBackend
from .zero import DeepSpeedMPU, EngineSteps, deepspeed_with_mpu


class PipelineZeRO1(ExpertsBesideZeRO, EngineSteps, PipelineBackend):
    """The pipeline's schedule, DeepSpeed's engine in place of a data-parallel wrap component (it steps inside
    clip(): a non-finite step cannot be skipped)."""

    name = "pipeline over DeepSpeed ZeRO-1"
    short = "hfpar pipeline + DeepSpeed"

    @classmethod
    def loads_full_state(cls, strategy: str) -> bool:
        return False  # DeepSpeed's partitions over each stage's dp group: resumes on its own mesh only

    def writes_full_state(self) -> bool:
        return False

    @classmethod
    def problems(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        p = []
        if mixed_precision != "no":
            p.append(
                f"--pp_size {ctx.pp} with {strategy} and {mixed_precision}: DeepSpeed's {mixed_precision} "
                "optimizer takes grads in its engine's backward, which the pipeline schedule bypasses; pass "
                "--mixed_precision no, or use ddp.yaml / fsdp2.yaml for bf16"
            )
        return p

    def prepare(self, stage) -> None:
        stage.to(self.acc.device)
        experts, saved = self._take_experts(stage)
        first_tp = self.ctx.tp_rank == 0
        for p in stage.parameters():  # what DeepSpeed's norm counts, and where (module docstring)
            p.tensor_model_parallel = bool(getattr(p, "tensor_model_parallel", False)) or first_tp
        if stage.tied is not None and stage.is_last:
            stage.tied.tensor_model_parallel = False  # the first stage counts it
        # collective, every rank in the same order: the stages x TP ranks of each replica (the pipeline group at tp 1)
        mp_group = new_groups(self.ctx.rank_lists("pp", "tp")) if self.ctx.tp > 1 else self.ctx.pp_group
        self.expert_norm_group = self.ctx.pp_group  # a stage's experts are not on the other stages
        self.base_optimizer = build_optimizer(stage, self.args, skip=frozenset(id(p) for p in experts))
        with deepspeed_with_mpu(DeepSpeedMPU(mp_group, self.ctx.replica_group)):
            self.model, self.optimizer = self.acc.prepare(stage, self.base_optimizer)
        self._setup_experts(experts, saved)
        self._pipeline(stage)
        self.model.set_gradient_accumulation_boundary(False)

    def clip(self, max_norm: float) -> float:
        stage, engine = self.unwrapped(), self.model
        sync_partial_grads(stage.parameters())
        if self.tied_group is not None:
            stage.sync_tied_grads(self.tied_group)
        engine.set_gradient_accumulation_boundary(True)
        engine.optimizer.reduce_gradients(pipeline_parallel=True)  # the stage's dense grads over its dp group
        engine.step()  # DeepSpeed's norm (the experts' joined: ExpertsBesideZeRO), clip and step of the dense part
        if self.experts:
            return float(self._clip_experts(max_norm))
        return float(engine.get_global_grad_norm())

    def step(self, lr: float) -> None:
        self._step_experts(lr)  # DeepSpeed stepped the rest in clip()

    def zero_grad(self) -> None:
        self.model.optimizer.zero_grad(set_to_none=True)
        self._zero_expert_grads()
        self.model.set_gradient_accumulation_boundary(False)
