"""TEST-ONLY: Accelerate's fp16 path (GradScaler + fp16 autocast) on CPU, for real fp16 launches without a GPU.

    PYTHONPATH=tests/helpers/fp16_cpu HFPAR_TEST_FP16_CPU=1 accelerate launch ... --mixed_precision fp16 recipes/sft.py
    ... (tests/launch/test_fp16_parity.py does this; HFPAR_TEST_FP16_INIT_SCALE=1048576 makes the first steps overflow;
    HFPAR_TEST_FP16_TRACE=DIR writes DIR/rank<R>.jsonl: one line per GradScaler.update, see _trace below)

Python imports a `sitecustomize` module found on sys.path at start-up, so every process of the launch (the
launcher and each rank) runs this file first. Nothing happens unless HFPAR_TEST_FP16_CPU=1.

Accelerate 1.15 turns fp16 on only off CPU (Accelerator.__init__: `self.device.type != "cpu"`), so on CPU it builds
no GradScaler and no fp16 autocast, and hfpar's preflight refuses the launch. torch 2.13 runs both on CPU
(torch.autocast("cpu", dtype=torch.float16), torch.amp.GradScaler("cpu")). After Accelerate's own __init__, this
sets what that branch sets on a GPU: native_amp = True (prepare() then wraps forwards in
get_mixed_precision_context_manager, i.e. fp16 autocast on the state's device, CPU here; acc.autocast() too) and the
scaler Accelerate would build (get_fsdp2_grad_scaler(device=...) under FSDP2, else get_grad_scaler's GradScaler,
for the CPU device), with the GradScalerKwargs the script passed. From there on acc.backward scales, clip_grad_norm_
unscales, AcceleratedOptimizer.step skips overflowed steps, and hfpar's model-parallel backends pick the scaler up
(hfpar.backends.loss_scale) exactly as on a GPU. DeepSpeed is left alone (it runs its own fp16 loss scaler).
"""

import json
import os

if os.environ.get("HFPAR_TEST_FP16_CPU") == "1":  # the patch of Accelerator
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    _accelerator_init = Accelerator.__init__

    def _init_with_cpu_fp16(self, *args, **kwargs):
        _accelerator_init(self, *args, **kwargs)
        if (
            self.state.mixed_precision != "fp16"
            or self.device.type != "cpu"
            or self.scaler is not None
            or self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        ):
            return
        self.native_amp = True
        scaler_kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
        if os.environ.get("HFPAR_TEST_FP16_INIT_SCALE"):
            scaler_kwargs["init_scale"] = float(os.environ["HFPAR_TEST_FP16_INIT_SCALE"])
        if self.is_fsdp2:
            self.scaler = get_fsdp2_grad_scaler(device="cpu", **scaler_kwargs)
        elif self.distributed_type == DistributedType.FSDP:  # FSDP1: get_grad_scaler's ShardedGradScaler
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device="cpu", **scaler_kwargs)
        else:  # get_grad_scaler's torch.amp.GradScaler(<device>) for the CPU device
            self.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)

    Accelerator.__init__ = _init_with_cpu_fp16


def _local_params(optimizer) -> list:
    return [p.to_local() if hasattr(p, "to_local") else p for g in optimizer.param_groups for p in g["params"]]


def _trace(trace_dir: str) -> None:
    """Record, on each rank, what every optimizer step under the GradScaler did: whether the scaler found an
    overflow (its found-inf flags, as step() read them), whether this rank's parameters (its local shards) changed
    in step(), and the scale after update(). One JSON line per step in trace_dir/rank<RANK>.jsonl."""
    import torch

    scaler_step, scaler_update = torch.amp.GradScaler.step, torch.amp.GradScaler.update
    path = os.path.join(trace_dir, f"rank{os.environ.get('RANK', '0')}.jsonl")

    def step(self, optimizer, *args, **kwargs):
        before = [p.detach().clone() for p in _local_params(optimizer)]
        out = scaler_step(self, optimizer, *args, **kwargs)
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        self._hfpar_trace = {
            "found_inf": any(float(f.sum()) > 0 for f in flags.values()),
            "params_changed": any(not torch.equal(b, p.detach()) for b, p in zip(before, _local_params(optimizer))),
        }
        return out

    def update(self, new_scale=None):
        scaler_update(self, new_scale)
        with open(path, "a") as f:
            f.write(json.dumps({**getattr(self, "_hfpar_trace", {}), "scale": self.get_scale()}) + "\n")

    torch.amp.GradScaler.step, torch.amp.GradScaler.update = step, update


if os.environ.get("HFPAR_TEST_FP16_CPU") == "1" and os.environ.get("HFPAR_TEST_FP16_TRACE"):
    _trace(os.environ["HFPAR_TEST_FP16_TRACE"])
