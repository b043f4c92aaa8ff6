"""hfpar's TP / EP model inside an Accelerate loop: one call turns the Accelerator's wrap, data, clipping and saving
into the right ones for a model sharded by hfpar.integrations.parallelize.

    accelerator = Accelerator()                          # under torchrun / accelerate launch: the process group
    ctx = parallelize(model, tp_size=2)                  # hfpar.integrations.model
    prepare_accelerator(accelerator, ctx)                # this module: BEFORE accelerator.prepare
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ... accelerator.backward(loss); accelerator.clip_grad_norm_(model.parameters(), 1.0); opt.step() ...
    accelerator.save_model(model, "out")                 # collective: a full HF checkpoint, from_pretrained loads it

What changes on THIS accelerator object (its methods replaced on the instance; nothing global is patched):
  prepare_model        Accelerate's own preparation (device, autocast) without its wrap, then DistributedDataParallel
                       over the dp group only (the ranks holding the same shards), experts left out of it; an
                       evaluation-mode model (a frozen reference) is not wrapped
  prepare_data_loader  rows sharded by dp rank over dp ranks: the TP ranks of a replica read identical batches
  prepare_optimizer    a step pre-hook: grads finished (partial TP grads summed, experts reduced over their group)
                       before every optimizer step, even without clipping
  clip_grad_norm_      finished grads, then the ONE global norm (shards once, replicas once)
  get_state_dict / save_model   the gathered full state dict (collective) / save_pretrained by rank 0

why: docs/architecture.md#why-backends-and-integrations
"""

from __future__ import annotations

import types

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel as DDP

from hfpar.parallel.guard import release
from hfpar.parallel.sharding import shard_spec

from .model import clip_grad_norm_, context_of, finish_grads, gathered_state_dict, save_pretrained

__all__ = ["prepare_accelerator"]

# the distributed types whose wrap is a DDP over process groups (the ones this module re-targets at the dp group)
_DDP_TYPES = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_HPU,
)


def prepare_accelerator(accelerator, ctx) -> None:
    """Make `accelerator` wrap, feed, clip and save a model sharded by parallelize() correctly (ctx: what
    parallelize returned, or the model itself). Call once, before accelerator.prepare(...)."""
    ctx = context_of(ctx) if isinstance(ctx, torch.nn.Module) else ctx
    if ctx is None:
        raise ValueError(
            "prepare_accelerator: no hfpar ParallelContext; pass what hfpar.integrations.parallelize "
            "returned (or the model it sharded)"
        )
    if accelerator.distributed_type not in _DDP_TYPES:
        raise ValueError(
            f"prepare_accelerator: Accelerate's {accelerator.distributed_type} wrap is not supported "
            "with hfpar's TP / EP layers here; use a DDP config (ddp.yaml / multi-GPU / multi-CPU), or "
            "hfpar's recipes for FSDP2 / ZeRO over TP and EP"
        )
    if getattr(accelerator, "_hfpar_context", None) is not None:
        return
    accelerator._hfpar_context = ctx
    accelerator._hfpar_finished = False  # grads of the current step already finished (by clip_grad_norm_)
    models: list[torch.nn.Module] = []  # the hfpar models this accelerator prepared for training

    def _prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if getattr(model, "_is_accelerate_prepared", False) or context_of(model) is None:
            return type(self).prepare_model(self, model, device_placement, evaluation_mode)
        inner = type(self).prepare_model(self, model, device_placement, evaluation_mode=True)  # device, autocast
        if evaluation_mode:
            return inner
        release(inner)  # the stock-DDP refusal apply_* armed: this wrap is the right one
        ignored = [n for n, p in inner.named_parameters() if (s := shard_spec(p)) is not None and s.dp_by_hfpar]
        DDP._set_params_and_buffers_to_ignore_for_model(inner, ignored)
        models.append(inner)
        if ctx.grad_replicas == 1:  # one replica: nothing to reduce
            return inner
        dev = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DDP(inner, process_group=ctx.replica_group, device_ids=dev)
        self._models[self._models.index(inner)] = wrapped
        wrapped._is_accelerate_prepared = True
        return wrapped

    def _prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        # Accelerator.prepare_data_loader's own call, with dp size / dp rank in place of world size / process index
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=ctx.dp,
            process_index=ctx.dp_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def _finish(self) -> None:
        if not self._hfpar_finished:
            finish_grads(p for m in models for p in m.parameters())
        self._hfpar_finished = False

    def _prepare_optimizer(self, optimizer, device_placement=None):
        prepared = type(self).prepare_optimizer(self, optimizer, device_placement)
        prepared.optimizer.register_step_pre_hook(lambda *_: _finish(self))
        return prepared

    def _clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if norm_type != 2:
            raise ValueError(f"hfpar clip_grad_norm_: norm_type {norm_type}; the global norm is the L2 norm (2)")
        self.unscale_gradients()
        norm = clip_grad_norm_(parameters, max_norm)  # finishes the grads first
        self._hfpar_finished = True
        return norm

    def _get_state_dict(self, model, unwrap=True):
        return gathered_state_dict(model)

    def _save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        save_pretrained(model, save_directory, max_shard_size=max_shard_size)

    for name, fn in (
        ("prepare_model", _prepare_model),
        ("prepare_data_loader", _prepare_data_loader),
        ("prepare_optimizer", _prepare_optimizer),
        ("clip_grad_norm_", _clip_grad_norm_),
        ("get_state_dict", _get_state_dict),
        ("save_model", _save_model),
    ):
        setattr(accelerator, name, types.MethodType(fn, accelerator))
