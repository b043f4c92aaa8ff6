"""The model side of hfpar inside other people's training code: shard it, finish its grads, gather it back.

    ctx = parallelize(model, tp_size=2, ep_size=1)    # EP then TP in place over the launched world (torchrun)
    finish_grads(model.parameters())                  # partial grads summed over TP, experts reduced over their group
    norm = clip_grad_norm_(model.parameters(), 1.0)   # finish_grads + ONE global norm (shards once, replicas once)
    save_pretrained(model, "out", tokenizer)          # collective: the full HF checkpoint, written by rank 0

The data-parallel side (the wrap over the dp group only, the rows each rank reads) is accelerator.py / trainer.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpar.context import ContextError, ParallelContext, model_config_problems
from hfpar.parallel.expert_parallel import apply_expert_parallel
from hfpar.parallel.guard import refuse_unlaunched
from hfpar.parallel.sharding import (
    clip_grads_,
    full_state_dict,
    gather_shards,
    reduce_dp_grads,
    shard_spec,
    sync_partial_grads,
    unique_params,
)
from hfpar.parallel.tensor_parallel import apply_tensor_parallel

__all__ = [
    "clip_grad_norm_",
    "context_of",
    "finish_grads",
    "gathered_grads",
    "gathered_state_dict",
    "parallelize",
    "save_pretrained",
]

_CTX = "_hfpar_context"


def parallelize(
    model: torch.nn.Module,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    sequence_parallel: bool = False,
    aux_loss_coef: float | None = None,
) -> ParallelContext:
    """Shard `model` in place (experts over ep_size ranks, then tensor parallelism over tp_size consecutive ranks) on
    the launched world, and return its ParallelContext (dp = world / tp; EP drawn from the dp ranks). Every rank must
    hold the same full weights on entry. The process group must exist (TrainingArguments(...) or Accelerator()
    create it under torchrun / accelerate launch); without it, under a launcher, this refuses."""
    refuse_unlaunched("hfpar.integrations.parallelize")
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    ctx = ParallelContext.from_degrees(world, rank, tp=tp_size, ep=ep_size, sequence_parallel=sequence_parallel)
    problems = model_config_problems(ctx, getattr(model, "config", None))
    if problems:
        raise ContextError("; ".join(problems))
    ctx.build_groups()
    if ctx.ep > 1:
        apply_expert_parallel(model, ctx, aux_loss_coef=aux_loss_coef)
    if ctx.tp > 1:
        apply_tensor_parallel(model, ctx, sequence_parallel=sequence_parallel)
    model.__dict__[_CTX] = ctx
    return ctx


def context_of(model: torch.nn.Module) -> ParallelContext | None:
    """The ParallelContext parallelize() recorded on the model (through DDP / Accelerate wrappers)."""
    while not hasattr(model, _CTX) and hasattr(model, "module"):
        model = model.module
    return getattr(model, _CTX, None)


def finish_grads(parameters) -> None:
    """After the last backward of a step, before the norm: partial grads of replicated parameters (q/k norms,
    sequence-parallel norms) summed over their TP group; expert grads (left out of DDP) reduced over the ranks holding
    the same experts and divided by dp. The same two calls hfpar's ModelParallelBackend.clip makes."""
    params = unique_params(parameters)
    sync_partial_grads(params)
    reduce_dp_grads(params)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """finish_grads, then clip by the one global norm (every TP / EP shard counted once, replicated parameters
    once); returns the norm before clipping. Once per step INSTEAD of finish_grads (which sums partial grads)."""
    params = unique_params(parameters)
    finish_grads(params)
    return clip_grads_(params, max_norm)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every rank): full tensors under the HF names, on CPU."""
    full = full_state_dict(_unwrapped(model))
    return {k: v.detach().cpu().contiguous() for k, v in full.items()}


def save_pretrained(model: torch.nn.Module, output_dir: str, tokenizer=None, **kwargs) -> None:
    """Collective: gather the full weights on every rank; rank 0 writes a normal HF checkpoint (from_pretrained
    loads it, whatever tp / ep was)."""
    full = gathered_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _unwrapped(model).save_pretrained(output_dir, state_dict=full, safe_serialization=True, **kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def gathered_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Debugging: every parameter's FULL gradient under its HF name (collective; after finish_grads or
    clip_grad_norm_, which finish the grads of a step: call one of them once). TP / EP
    shards gathered the way the weights are; parameters without a grad are left out."""
    out = {}
    for name, p in _unwrapped(model).named_parameters():
        spec = shard_spec(p)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if spec is not None and spec.sharded and spec.group is not None:
            g = gather_shards(g, spec.dim, spec.group, spec.packed_splits)
        if p.grad is not None:
            out[name] = g.detach().cpu()
    return out
