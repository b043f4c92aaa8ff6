"""Pipeline parallelism over DeepSpeed ZeRO-1: each stage's optimizer state partitioned over its dp group.

    backend = PipelineZeRO1(accelerator, ctx, "zero1", args); backend.prepare(stage)   # a PipelineStage

The schedule runs its backwards itself (several per step, in an order that differs between stages), so
DeepSpeed's engine never sees them: grads accumulate in the stage's parameters as with PipelineDDP, and at the
step the ZeRO-1 optimizer reduces them over the stage's dp group the way DeepSpeed's own PipelineEngine has it
do (`reduce_gradients(pipeline_parallel=True)`), then the engine takes its step with the boundary set by hand.
DeepSpeed gets a "model parallel unit" whose data-parallel group is the stage's replica group (ZeRO partitions
and broadcasts there only) and whose model-parallel group is the pipeline: with every parameter tagged as
model-parallel its grad-norm sums each stage's squares over the stages (DeepSpeed counts an untagged parameter
on model-parallel rank 0 only; the last stage's copy of a tied embedding is left untagged for that reason, the
first stage's copy is counted). DeepSpeed clips and steps with that norm.

Why fp32 only: under bf16 DeepSpeed's zero1 runs its BF16_Optimizer and under fp16 it scales the loss in
engine.backward, both of which the schedule's backwards bypass (refused in check()). TP with ZeRO-1 and
pipeline parallelism is refused by the support table: DeepSpeed's norm has one model-parallel group, which
cannot both sum stages and count TP-replicated parameters once.
"""

from __future__ import annotations

from hfpar.train.optim import build_optimizer
from hfpar.parallel.sharding import sync_partial_grads

from .pipeline import PipelineBackend
from .zero import DeepSpeedMPU, EngineSteps, deepspeed_with_mpu


class PipelineZeRO1(EngineSteps, PipelineBackend):
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
    def check(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        p = []
        if mixed_precision != "no":
            p.append(f"--pp_size {ctx.pp} with {strategy} and {mixed_precision}: DeepSpeed's {mixed_precision} "
                     "optimizer takes grads in its engine's backward, which the pipeline schedule bypasses; pass "
                     "--mixed_precision no, or use ddp.yaml / fsdp2.yaml for bf16")
        if args.on_nonfinite == "skip":
            p.append(f"--on_nonfinite skip with {strategy}: DeepSpeed steps its optimizer before the trainer sees "
                     "the grad norm, so a step cannot be skipped; use --on_nonfinite error")
        return p

    def prepare(self, stage) -> None:
        stage.to(self.acc.device)
        for p in stage.parameters():   # counted by DeepSpeed's grad norm on every stage, summed over the pipeline
            p.tensor_model_parallel = True
        if stage.tied is not None and stage.is_last:
            stage.tied.tensor_model_parallel = False   # the first stage (model-parallel rank 0) counts it
        self.base_optimizer = build_optimizer(stage, self.args)
        with deepspeed_with_mpu(DeepSpeedMPU(self.ctx.pp_group, self.ctx.replica_group)):
            self.model, self.optimizer = self.acc.prepare(stage, self.base_optimizer)
        self._pipeline(stage)
        self.model.set_gradient_accumulation_boundary(False)

    def clip(self, max_norm: float) -> float:  # noqa: ARG002  (DeepSpeed clips by its config's gradient_clipping)
        stage, engine = self.unwrapped(), self.model
        sync_partial_grads(stage.parameters())
        if self.tied_group is not None:
            stage.sync_tied_grads(self.tied_group)
        engine.set_gradient_accumulation_boundary(True)
        engine.optimizer.reduce_gradients(pipeline_parallel=True)   # the stage's grads over its dp group
        engine.step()
        return float(engine.get_global_grad_norm())

    def step(self, lr: float) -> None:
        pass  # DeepSpeed stepped in clip()

    def zero_grad(self) -> None:
        self.model.optimizer.zero_grad(set_to_none=True)
        self.model.set_gradient_accumulation_boundary(False)

    def save_rank_state(self, ckpt_dir) -> None:
        pass  # Accelerate's save_state writes DeepSpeed's checkpoint: each stage's weights and optimizer partitions

    def load_rank_state(self, ckpt_dir) -> None:
        pass
