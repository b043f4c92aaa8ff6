"""The data-parallel wrap, as a component the model-parallel and pipeline backends hold (not a base they inherit).

    dp = FullyShard(); problems = FullyShard.check(args, ctx, "fsdp2", "bf16")
    model = dp.wrap(accelerator, ctx, model, layer_types={"LlamaDecoderLayer"}, ignored=experts)

Each wrap reduces the grads of the parameters every rank of a replica holds over the dp x cp group only (never
the world, which would average different TP shards / experts / stages together):
  TorchDDP        DistributedDataParallel over the replica group; experts left out (ranks hold different ones, and
                  DDP would broadcast rank 0's at wrap time): hfpar reduces them over the ranks holding the same ones
  HfparAllReduce  no wrapper: each parameter's ShardSpec names its dp group and hfpar's bucketed all-reduce runs once
                  per optimizer step (the pipeline: its schedule runs several backwards per step, in an order that
                  differs between stages)
  FullyShard      FSDP2's `fully_shard` on a 1-D mesh of the replica group, one unit per decoder layer; the
                  accelerate config's FSDP2 settings (Accelerate's own plugin objects: its MixedPrecisionPolicy,
                  reshard_after_forward, the CPUOffloadPolicy of fsdp_offload_params) passed as accelerate's
                  fsdp2_prepare_model does. FSDP2 replaces the Parameter objects: their ShardSpecs are carried over
                  by name. Its ranks of a replica hold different shards: per-rank checkpoint files.
"""

from __future__ import annotations

import os
import warnings

import torch
from accelerate.utils import str_to_bool
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from hfpar.parallel.guard import release
from hfpar.parallel.sharding import carry_shard_specs, set_shard_spec, shard_spec

# torch 2.13's FSDP2 warns, once per forward, when a wrapped module returns a view ("An in-place op on this view
# ... will silently drop the pre-backward hook"). Here the views are the logits: F.linear of a 3-D input returns its
# 2-D matmul reshaped (a view), from the lm_head (grouped with the final norm) and from the CausalLM root that returns
# it; hfpar's loss reads them out of place only. That is verified, not assumed: every FSDP2 composition equals the
# one-process run within 1e-4 in loss, grad norm and weights (tests/launch/test_backends_parity.py and the TP / EP /
# CP / PP parity files). Silenced for those modules only: a view from any other module still warns.
VIEW_WARNING = (
    r"FSDP2-wrapped module \((FSDP\w*Norm, )?FSDP\w*(ForCausalLM|ForSequenceClassification|Linear)\) returned a view"
)
warnings.filterwarnings("ignore", category=UserWarning, message=VIEW_WARNING)


class DataParallelWrap:
    """The interface: check (before any model is loaded), wrap (the model or stage, in place or wrapped)."""

    per_rank_shards = False  # the ranks of a replica hold different shards of a parameter
    # some parameters may get no gradient in a step (a vision-language model: LLaVA's unused post_layernorm, the
    # tower of a batch without images): DDP then looks for them each step (TRL does the same for VLMs)
    find_unused_parameters = False
    prepends_hooks = False  # adds forward pre-hooks of its own ahead of the model's (a stage re-hooks after it)

    @staticmethod
    def check(args, ctx, strategy: str, mixed_precision: str) -> list[str]:  # noqa: ARG004
        return []

    def wrap(
        self, accelerator, ctx, model: torch.nn.Module, *, layer_types: set[str], ignored: list[torch.nn.Parameter]
    ) -> torch.nn.Module:
        raise NotImplementedError


class TorchDDP(DataParallelWrap):
    def wrap(self, accelerator, ctx, model, *, layer_types, ignored):  # noqa: ARG002
        if ctx.grad_replicas == 1:
            return model
        release(model)  # the stock-DDP refusal apply_* armed (hfpar.parallel.guard): this wrap is the right one
        skip = {id(p) for p in ignored}
        names = [n for n, p in model.named_parameters() if id(p) in skip]
        if names:
            DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        dev = [accelerator.device.index] if accelerator.device.type == "cuda" else None
        return DDP(
            model, process_group=ctx.replica_group, device_ids=dev, find_unused_parameters=self.find_unused_parameters
        )


class HfparAllReduce(DataParallelWrap):
    def wrap(self, accelerator, ctx, model, *, layer_types, ignored):  # noqa: ARG002
        keep = {id(p) for p in ignored}  # experts: reduced over the ranks holding the same ones (their ShardSpec)
        if ctx.grad_replicas > 1:
            for p in model.parameters():
                if id(p) not in keep:
                    set_shard_spec(p, dp_reduce_group=ctx.replica_group, dp_size=ctx.grad_replicas)
        return model


class FullyShard(DataParallelWrap):
    per_rank_shards = True
    prepends_hooks = True

    @staticmethod
    def check(args, ctx, strategy: str, mixed_precision: str) -> list[str]:  # noqa: ARG004
        p = []
        # the launcher passes fsdp_offload_params as this variable; Accelerate's plugin reads the same one
        if str_to_bool(os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), to_bool=True):
            flags = " and ".join(f"--{k}_size {getattr(ctx, k)}" for k in ("tp", "ep", "cp") if getattr(ctx, k) > 1)
            p.append(
                f"fsdp_offload_params: true with {flags}: hfpar's TP / EP grad reductions and norm run on the "
                "device, not on CPU-offloaded grads; set fsdp_offload_params: false (or use zero3_offload.yaml "
                "without model parallelism)"
            )
        if ctx.ep > 1 and mixed_precision == "fp16":
            # the experts stay outside FSDP2 (plain tensors) while the rest are DTensors: torch's GradScaler unscales
            # one optimizer's grads in a single foreach call, which refuses the mix (measured in a CPU fp16 launch)
            p.append(
                f"--ep_size {ctx.ep} with fsdp2 and fp16: the GradScaler cannot unscale the experts' grads "
                "together with FSDP2's sharded ones; use bf16 (or ddp.yaml with fp16)"
            )
        return p

    def wrap(self, accelerator, ctx, model, *, layer_types, ignored):
        mesh = ctx.dp_mesh(accelerator.device.type)
        release(model)  # the stock-fully_shard refusal apply_* armed (hfpar.parallel.guard)
        specs = {n: shard_spec(p) for n, p in model.named_parameters() if shard_spec(p) is not None}
        kw = {"ignored_params": set(ignored)} if ignored else {}
        settings = fsdp2_settings(accelerator)
        for module in model.modules():  # one FSDP unit per decoder layer, as the fsdp2 config does
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh, **kw, **settings)
        fully_shard(model, mesh=mesh, **kw, **settings)
        carry_shard_specs(model, specs)
        return model


def fsdp2_settings(accelerator) -> dict:
    """fully_shard's keyword arguments from the accelerate config in effect: the FSDP plugin's own objects, as
    accelerate's fsdp2_prepare_model passes them (it sets the policy from mixed_precision when the state is made)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if plugin is None:  # no FSDP config (a backend built by hand): fully_shard's defaults
        return {}
    return {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
