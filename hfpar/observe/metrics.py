"""Measurements of a run: per-rank bytes held, peak memory, metrics.jsonl, run_info.json.

Bytes are counted from what each rank really holds: the local shard of an FSDP2 DTensor,
the ZeRO-3 partition (`ds_tensor`), the optimizer state tensors behind any wrapper, the gradients
the optimizer steps with (track_grad_bytes / grad_bytes: grads are freed between steps).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import resource
import sys
from pathlib import Path

import accelerate
import datasets
import torch
import transformers
from torch.optim.optimizer import register_optimizer_step_pre_hook

import hfpar


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters stored on this rank (sharded strategies count their shard only)."""
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition; p itself is an empty placeholder
            total += p.ds_tensor.numel() * p.ds_tensor.element_size()
        else:
            loc = _local(p)
            total += loc.numel() * loc.element_size()
    return total


def param_count(model: torch.nn.Module) -> int:
    """Full (unsharded) parameter count."""
    n = 0
    for p in model.parameters():
        n += p.ds_numel if hasattr(p, "ds_numel") else p.numel()
    return n


def _base_optimizer(opt):
    seen = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        if isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch.optim"):
            return opt
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            return opt
        opt = inner
    return opt


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state (e.g. Adam moments) held by this rank, under any wrapper."""
    base = _base_optimizer(optimizer)
    total = 0
    for state in getattr(base, "state", {}).values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                loc = _local(v)
                total += loc.numel() * loc.element_size()
    return total


_GRAD_BYTES: dict[int, dict[int, int]] = {}  # id(torch optimizer) -> {id(param): bytes of its grad at its last step}
_grad_hook = None


def _is_torch_optimizer(opt) -> bool:
    return isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch.optim")


def _record_grad_bytes(optimizer, args, kwargs) -> None:
    if not _is_torch_optimizer(optimizer):  # wrappers (Accelerate's) step the torch optimizer, counted there
        return
    seen = _GRAD_BYTES.setdefault(id(optimizer), {})
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = _local(p.grad)
                seen[id(p)] = g.numel() * g.element_size()


def track_grad_bytes() -> None:
    """From now on, record at every optimizer step of this process the bytes of the gradients it steps with:
    the local shard under FSDP2, DeepSpeed ZeRO's gradient partitions (its inner torch optimizer is stepped
    once per sub-group, each time with that sub-group's partition; counted per parameter, so all add up).
    Idempotent; call before the first optimizer step."""
    global _grad_hook
    if _grad_hook is None:
        _grad_hook = register_optimizer_step_pre_hook(_record_grad_bytes)


def grad_bytes(optimizer=None) -> int:
    """Gradient bytes this rank's optimizer (any wrapper; None: every optimizer of the process) stepped with
    at its last step; 0 if track_grad_bytes() was not active then."""
    if optimizer is None:
        return sum(sum(d.values()) for d in _GRAD_BYTES.values())
    return sum(_GRAD_BYTES.get(id(_base_optimizer(optimizer)), {}).values())


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (host memory, whatever the device; ru_maxrss is KiB on
    Linux). Includes file pages mapped while reading safetensors (hfpar.loading.sharded closes each file when done)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_rss_bytes()  # CPU: the process's peak RSS


def library_versions() -> dict:
    """Versions of the libraries a run depends on, without importing any that is not loaded yet: optional
    ones (deepspeed: ~0.5 s to import) are read from their installed metadata."""
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "datasets": datasets.__version__,
    }
    try:
        loaded = sys.modules.get("deepspeed")  # its own __version__ when a ZeRO backend imported it
        out["deepspeed"] = getattr(loaded, "__version__", None) or importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:  # deepspeed is an optional extra
        out["deepspeed"] = None
    out["hfpar"] = hfpar.__version__
    return out


def run_metadata(optimizer, implementation) -> dict:
    """What run_info.json says of the run besides measurements: library versions, the command line and the
    optimizer implementation that steps the parameters (`implementation(torch_optimizer)`: hfpar.backends.optim's,
    handed in by the trainer so that observe imports nothing of train). Gathered once, before the first step."""
    return {
        "optimizer": implementation(_base_optimizer(optimizer)),
        "optimizer_wrappers": _wrappers(optimizer),
        "versions": library_versions(),
        "command": command_line(),
    }


def _wrappers(opt) -> list[str]:
    """Class names of the wrappers around torch's optimizer, outermost first (e.g. AcceleratedOptimizer,
    BF16_Optimizer: DeepSpeed picks its optimizer class from the precision and stage, and hfpar joins its norm)."""
    names, base = [], _base_optimizer(opt)
    while opt is not None and opt is not base and type(opt).__name__ not in names:
        names.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
    return names


class MetricsWriter:
    """Appends one JSON object per line to output_dir/metrics.jsonl (main process only)."""

    def __init__(self, path: str | Path, enabled: bool, append: bool):
        self.path = Path(path)
        self.enabled = enabled
        if enabled and not append and self.path.exists():
            self.path.unlink()

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")


def write_json(path: str | Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n")


def command_line() -> str:
    return " ".join(sys.argv)
