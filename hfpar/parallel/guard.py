"""The sharding record apply_tensor_parallel / apply_expert_parallel leave on a model, and the refusals it arms.

    mark_parallel(model, "tensor-parallel over 2 ranks")   # apply_*: every module holding a shard is guarded
    parallel_record(model)                                 # ["tensor-parallel over 2 ranks", ...] or None
    release(model)                                         # hfpar's own data-parallel wraps, before wrapping
    refuse_unlaunched("apply_tensor_parallel")             # WORLD_SIZE > 1 but no process group: refuse

Refused: a stock data-parallel wrap over the whole world of a TP / EP model
(why: docs/architecture.md#why-the-parallel-layers). Nothing global is patched; the entry points read an attribute
of the module they wrap, which the guard sets:
  DDP          DistributedDataParallel.__init__ reads `module._ddp_params_and_buffers_to_ignore` (and iterates it)
               before any broadcast: the guard is an object whose iteration raises the one-line refusal.
  fully_shard  torch's composable-API contract checks `func in module.__dict__[STATE_KEY]` before sharding: the
               guard is a dict whose membership test raises the refusal for fully_shard / replicate.
  FSDP (1)     FullyShardedDataParallel.__init__ asks every module whether it composes with it
               (`"replicate" in module.__dict__[REGISTRY_KEY]`, fsdp._traversal_utils._composable) before any
               broadcast: the guard is a registry whose membership test for "replicate" raises the refusal.
  DeepSpeed    deepspeed.initialize reads nothing of the module that could refuse before it broadcasts rank 0's
               parameters (accelerator.prepare / Trainer with a DeepSpeed config reach it too). So the refusal comes at
               the first forward: a pre-hook on the model looks for a DeepSpeedEngine among its callers (the engine's
               forward calls the model directly) and refuses before any step has run on the broadcast weights.
Every module holding a sharded parameter (its ancestors included) carries both, so wrapping a submodule (FSDP2's one
unit per decoder layer) is refused too. hfpar's safe calls (hfpar.integrations, hfpar.backends.wraps and hfpar's
DeepSpeed backends, which give DeepSpeed the dp group) release them.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY  # composable APIs applied
from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY  # where fully_shard keeps its state

__all__ = ["SAFE_CALLS", "mark_parallel", "parallel_record", "refuse_unlaunched", "release"]

_RECORD = "_hfpar_parallel"
_DDP_KEY = "_ddp_params_and_buffers_to_ignore"
_ENGINE_HOOK = "_hfpar_engine_hook"
_ENGINE_DEPTH = 6  # frames between a DeepSpeedEngine's forward and the model's pre-hook (Module._call_impl's)
SAFE_CALLS = (
    "hfpar.integrations.prepare_trainer(trainer) before trainer.train() (Trainer, TRL), or "
    "hfpar.integrations.prepare_accelerator(accelerator) before accelerator.prepare(model) "
    "(docs/own-code.md)"
)


def _message(what: str, record: list[str]) -> str:
    return (
        f"hfpar: {what} of a model that is {' and '.join(record)} would wrap it over the whole world (rank 0's "
        f"shards broadcast or different shards averaged: silently wrong); use {SAFE_CALLS}"
    )


class _RefuseDDP:
    """Stands where DDP reads its ignored-parameter names; iterating it (DDP.__init__) refuses."""

    def __init__(self, record: list[str]) -> None:
        self.record = record

    def __iter__(self):
        raise RuntimeError(_message("torch.nn.parallel.DistributedDataParallel", self.record))

    def __deepcopy__(self, memo):
        return self


class _RefuseComposable(dict):
    """torch's composable-API state dict; `fully_shard in it` (the contract's first check) refuses."""

    def __init__(self, record: list[str]) -> None:
        super().__init__()
        self.record = record

    def __contains__(self, func) -> bool:
        name = getattr(func, "__name__", "")
        if name in ("fully_shard", "replicate"):
            raise RuntimeError(_message(f"torch.distributed.fsdp.{name}", self.record))
        return super().__contains__(func)

    def __deepcopy__(self, memo):
        return _RefuseComposable(self.record)


class _RefuseFSDP1(dict):
    """torch's composable-API registry; FSDP1 asks `"replicate" in it` of every module it would wrap: refuses."""

    def __init__(self, record: list[str]) -> None:
        super().__init__()
        self.record = record

    def __contains__(self, name) -> bool:
        if name == "replicate":
            raise RuntimeError(_message("torch.distributed.fsdp.FullyShardedDataParallel", self.record))
        return super().__contains__(name)

    def __deepcopy__(self, memo):
        return _RefuseFSDP1(self.record)


def _refuse_engine(module: nn.Module, args) -> None:
    """Forward pre-hook: refuse a forward called by a DeepSpeedEngine while the model is still guarded (hfpar's own
    DeepSpeed backends release it first). Costs a frame walk per forward only once deepspeed is imported."""
    guard = module.__dict__.get(_DDP_KEY)
    engine = sys.modules.get("deepspeed.runtime.engine")
    if engine is None or not isinstance(guard, _RefuseDDP):
        return
    frame = sys._getframe(1)
    for _ in range(_ENGINE_DEPTH):
        if frame is None:
            return
        if isinstance(frame.f_locals.get("self"), engine.DeepSpeedEngine):
            raise RuntimeError(
                f"hfpar: deepspeed.initialize (a DeepSpeedEngine, also what accelerator.prepare / Trainer build from a "
                f"DeepSpeed config) of a model that is {' and '.join(guard.record)} broadcast rank 0's shards over the "
                "whole world (silently wrong); ZeRO over hfpar's TP / EP is hfpar's recipes' path (zero1.yaml / "
                "zero2.yaml with --tp_size / --ep_size), in your own code use a DDP config with " + SAFE_CALLS
            )
        frame = frame.f_back


def mark_parallel(model: nn.Module, what: str) -> None:
    """Record `what` (e.g. "tensor-parallel over 2 ranks") on the model and guard every module holding a shard."""
    record = [*getattr(model, _RECORD, []), what]
    model.__dict__[_RECORD] = record
    if _ENGINE_HOOK not in model.__dict__:
        model.register_forward_pre_hook(_refuse_engine)
        model.__dict__[_ENGINE_HOOK] = True
    holders = {""}
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = getattr(p, "_hfpar_shard", None)  # hfpar.parallel.sharding's record
        if spec is not None and spec.size > 1:
            parts = name.split(".")[:-1]
            holders.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    for name in holders:
        module = model.get_submodule(name)
        module.__dict__[_DDP_KEY] = _RefuseDDP(record)
        state = module.__dict__.get(_STATE_KEY)
        if state is None or isinstance(state, _RefuseComposable):
            module.__dict__[_STATE_KEY] = _RefuseComposable(record)
        registry = module.__dict__.get(_REGISTRY_KEY)
        if registry is None or isinstance(registry, _RefuseFSDP1):
            module.__dict__[_REGISTRY_KEY] = _RefuseFSDP1(record)


def parallel_record(model: nn.Module) -> list[str] | None:
    """What apply_* recorded (None: the model holds no shard of a TP / EP layer)."""
    return getattr(model, _RECORD, None)


def release(model: nn.Module) -> None:
    """Remove the guards (hfpar's own data-parallel wrap over the right group follows); the record stays."""
    for module in model.modules():
        if isinstance(module.__dict__.get(_DDP_KEY), _RefuseDDP):
            del module.__dict__[_DDP_KEY]
        if isinstance(module.__dict__.get(_STATE_KEY), _RefuseComposable):
            del module.__dict__[_STATE_KEY]
        if isinstance(module.__dict__.get(_REGISTRY_KEY), _RefuseFSDP1):
            del module.__dict__[_REGISTRY_KEY]


def refuse_unlaunched(what: str) -> None:
    """Under a multi-process launcher (WORLD_SIZE > 1) without a process group, apply_* would shard over a world of
    one and say nothing: refuse."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what}: WORLD_SIZE={world} but torch.distributed is not initialized, so this would "
            "shard over a world of one; call dist.init_process_group(...) (or create the Accelerator "
            "/ TrainingArguments) first, or pass a process group"
        )
