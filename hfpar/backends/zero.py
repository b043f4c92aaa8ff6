"""What every DeepSpeed (ZeRO) backend shares: its engine steps inside backward and owns the fp16 loss scale,
and hfpar's groups reach it as a "model parallel unit".

    class MyZeRO(EngineSteps, Backend): ...                  # loss_scale / overflowed read from the engine
    with deepspeed_with_mpu(DeepSpeedMPU(tp_group, dp_group)):
        model, optimizer = accelerator.prepare(model, optimizer)

DeepSpeed gets a "model parallel unit" (mpu, Megatron's interface) naming the dp and model-parallel groups, so
ZeRO partitions and reduces over dp only and its grad norm sums the model-parallel shards. Accelerate passes no
mpu (only for its own Ulysses), so deepspeed.initialize is wrapped for the duration of prepare().
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from hfpar.distributed import swapped


def deepspeed_fp16_problem() -> str | None:
    """Why DeepSpeed cannot run fp16 here, else None. DeepSpeed picks its accelerator itself (CUDA when a GPU is
    visible, else its CPU one, whichever torch build is installed) and its engine stops at initialize, after the model
    loaded, with "Type fp16 is not supported on your device" when that accelerator reports no fp16; its CPU accelerator
    asks oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported(): x86 CPUs with AVX512-FP16 or AMX-FP16)."""
    # an optional dependency (hfpar[deepspeed]), imported on use as in mp_deepspeed.py: only ZeRO runs reach
    # this, and they import deepspeed a moment later anyway
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    accel = get_accelerator()
    if accel.is_fp16_supported():
        return None
    return (
        f"--mixed_precision fp16 with DeepSpeed ZeRO: DeepSpeed's {accel.device_name()} accelerator has no fp16 on "
        "this machine (DeepSpeed would refuse it at initialize, after the model loaded); use --mixed_precision "
        "bf16 or no"
    )


class EngineSteps:
    """Mixin of the backends whose model is a DeepSpeed engine (self.model): the optimizer steps inside the last
    micro-batch's backward, and the engine scales the fp16 loss itself."""

    steps_in_backward = True

    def loss_scale(self) -> float:
        """fp16: the scale DeepSpeed's own backward multiplies by; 1 without fp16 (or before prepare)."""
        if self.model is None:
            return 1.0
        return float(getattr(getattr(self.model, "optimizer", None), "loss_scale", 1.0) or 1.0)

    def overflowed(self, grad_norm: float) -> bool:  # noqa: ARG002
        """fp16: DeepSpeed's loss scaler already skipped the step inside backward (its overflow check is
        all-reduced over dp), which the engine reports."""
        engine = self.model
        return bool(engine.fp16_enabled()) and not engine.was_step_applied()


class DeepSpeedMPU:
    """The mpu `deepspeed.initialize(mpu=...)` takes: ZeRO over the dp group, grad norm aware of TP shards."""

    def __init__(self, tp_group, dp_group):
        self.tp_group, self.dp_group = tp_group, dp_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.dp_group)

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.tp_group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self.tp_group)[0]


@contextlib.contextmanager
def deepspeed_with_mpu(mpu: DeepSpeedMPU | None):
    """Pass `mpu` to the `deepspeed.initialize` that `accelerator.prepare` calls (looked up at call time)."""
    if mpu is None:
        yield
        return
    import deepspeed  # noqa: PLC0415  (an optional dependency, hfpar[deepspeed]; only ZeRO runs reach here)

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        kwargs.setdefault("mpu", mpu)
        return original(*args, **kwargs)

    with swapped(deepspeed, "initialize", initialize):
        yield
