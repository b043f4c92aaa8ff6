"""Liger's Triton kernels in the model's own modules (`--use_liger_kernel`, the name of HF's TrainingArguments and
TRL's configs): RMSNorm, the SwiGLU / GeGLU MLP and RoPE, put in place by Liger's own function for the model's family
(liger_kernel.transformers._apply_liger_kernel_to_instance) after loading, before hfpar's layers.

    problems = liger_problems(args, ctx, "cuda", config)   # the preflight: before the model loads
    info = apply_liger(model)                              # run_info.json: the family and the kernels

Not Liger's loss kernels (cross_entropy, fused_linear_cross_entropy): hfpar's chunked loss head already computes the
loss without the full logits, with the model's own loss semantics (its loss function, -100 labels, num_items);
Liger's fused loss would replace the model's forward.

Refused, each in one line: without CUDA (Triton GPU kernels), without the package, a family Liger has no function for
(its instance function would log and do nothing: a silent no-op), and beside hfpar's model-parallel layers (TP, EP,
CP, PP): their parity with the one-process model is tested against the model's own modules on CPU, where Liger cannot
run, so a composition that no test covers is refused rather than trusted. Data parallelism (DDP, FSDP2, ZeRO) only
splits rows, and Liger's kernels work per token.
"""

from __future__ import annotations

import importlib.util
import inspect

KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True}  # per family, those its function takes
OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}  # hfpar's chunked loss head computes the loss


def _families() -> dict:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: PLC0415 - optional

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_problems(args, ctx, device_type: str, config) -> list[str]:
    """One line per reason --use_liger_kernel cannot run here (empty without the flag)."""
    if not getattr(args, "use_liger_kernel", False):
        return []
    if device_type != "cuda":
        return [
            f"--use_liger_kernel: Liger's kernels are Triton GPU kernels and this run is on {device_type.upper()}; "
            "drop the option (it changes no result, only speed and memory on a GPU)"
        ]
    if importlib.util.find_spec("liger_kernel") is None:
        return ["--use_liger_kernel: the liger-kernel package is not installed (pip install liger-kernel)"]
    model_parallel = {"--tp_size": ctx.tp, "--ep_size": ctx.ep, "--cp_size": ctx.cp, "--pp_size": ctx.pp}
    used = [f"{k} {v}" for k, v in model_parallel.items() if v > 1]
    if used:
        return [
            f"--use_liger_kernel with {', '.join(used)}: hfpar's model-parallel layers are verified against the "
            "model's own modules, not Liger's; use it with data parallelism (DDP, FSDP2, ZeRO) or drop it"
        ]
    model_type = getattr(config, "model_type", None)
    if config is not None and model_type not in _families():
        return [
            f"--use_liger_kernel: Liger has no kernels for model_type {model_type!r} (it would apply nothing); "
            f"it has them for {', '.join(sorted(_families()))}"
        ]
    return []


def apply_liger(model) -> dict:
    """Liger's kernels into `model`'s modules, in place; what run_info.json records."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: PLC0415 - optional

    fn = _families()[model.config.model_type]
    taken = [k for k in KERNELS if k in inspect.signature(fn).parameters]
    _apply_liger_kernel_to_instance(model=model, **{k: True for k in taken}, **OFF)
    return {"family": model.config.model_type, "kernels": taken}
