"""The optimizer every backend builds: AdamW with HF Trainer's weight-decay rule, in the fastest exact form.

    optimizer = build_optimizer(model, args)          # args: optim, learning_rate, weight_decay, adam_*
    implementation(optimizer)                         # 'fused' | 'foreach' | 'for-loop'

--optim takes HF TrainingArguments' names:
  adamw_torch_fused  (default) torch's fused AdamW kernel (one kernel for all params of a device and dtype) where
                     every parameter sits on a device torch has it for (CUDA, CPU, ...), else the multi-tensor
                     `foreach` implementation; the same math, equal to float rounding (tests/distributed/test_optim.py)
                     (the for-loop where plain tensors and DTensors mix, which neither kernel takes: EP x FSDP2)
  adamw_torch        torch.optim.AdamW as torch picks it: foreach on CUDA, the per-parameter for-loop on CPU
The backends hand this optimizer on: FSDP2 swaps its parameters for DTensors (torch's fused kernels have DTensor
rules, so fused stays), DeepSpeed ZeRO steps it on its flat fp32 partitions (plain tensors on the same device),
and ZeRO-Offload replaces it by DeepSpeedCPUAdam (Accelerate does, the backend brings its own).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import (
    _default_to_fused_or_foreach,
    _get_fused_kernels_supported_devices,
)

from hfpar.config import OPTIMIZERS


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW runs on every parameter: a floating dtype on a device with fused kernels
    (torch checks the same at the first step, and would raise there)."""
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def one_kind(params: list[torch.Tensor]) -> bool:
    """Whether the parameters can go through one multi-tensor call: all plain tensors, or all DTensors of one
    mesh. EP x FSDP2 mixes them (experts stay plain next to FSDP2's DTensors), and DTensor refuses a fused or
    foreach op that mixes them ("got mixed torch.Tensor and DTensor")."""
    return len({getattr(p, "device_mesh", None) for p in params}) <= 1  # a DTensor's mesh; None: a plain tensor


def _impl_kwargs(params: list[torch.Tensor], optim: str) -> dict:
    if optim not in OPTIMIZERS:
        raise ValueError(f"--optim {optim!r}: valid values are {', '.join(OPTIMIZERS)}")
    if not one_kind(params):
        return {"foreach": False}  # the per-parameter for-loop: each op sees one kind of tensor
    if optim == "adamw_torch_fused":
        if fused_supported(params):
            return {"fused": True}
        # e.g. a device without fused kernels: foreach is the next fastest and needs nothing of the device
        # (torch falls back to per-tensor ops inside it where it has no multi-tensor kernel)
        return {"foreach": True}
    # adamw_torch: torch's own default, made explicit so that implementation() can say what runs
    return {"foreach": _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]}


def build_optimizer(model: torch.nn.Module | list, args, skip: frozenset = frozenset()) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (HF Trainer's rule: 1-D parameters). `model` may be a
    list of parameters; parameters whose id() is in `skip` are left out."""
    decay, no_decay = [], []
    for p in model.parameters() if isinstance(model, torch.nn.Module) else model:
        if p.requires_grad and id(p) not in skip:
            ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()  # ZeRO-3 init leaves empty placeholders
            (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # DeepSpeed drops empty groups, which would desync the scheduler
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        **_impl_kwargs(decay + no_decay, args.optim),
    )


def implementation(optimizer) -> str:
    """What steps the parameters, for run_info.json: 'fused', 'foreach' or 'for-loop' for torch's Adam family,
    else the optimizer's class (e.g. DeepSpeedCPUAdam under ZeRO-Offload)."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        if group.get("fused"):
            return "fused"
        if group.get("foreach") is None:  # torch decides at each step
            params = [p for g in optimizer.param_groups for p in g["params"]]
            return "foreach" if _default_to_fused_or_foreach(params, False, use_fused=False)[1] else "for-loop"
        return "foreach" if group["foreach"] else "for-loop"
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
