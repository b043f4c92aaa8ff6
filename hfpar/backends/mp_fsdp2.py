"""Model parallelism (TP, EP) over FSDP2: `fully_shard` on a 1-D mesh of the dp group (2-D: dp x tp).

    backend = ModelParallelFSDP2(accelerator, ctx, "fsdp2", args); backend.prepare(tp_model)

Why by hand: Accelerate's FSDP2 path shards over one mesh of the whole world, which would mix different
TP shards; here parameters become DTensors sharded over dp only, and every TP rank of a replica shards
its own TP shard of them. Experts are ignored by FSDP (sharded by EP already, reduced by hfpar).
FSDP2 replaces the Parameter objects: their ShardSpecs are carried over by name.
The accelerate config's FSDP2 settings apply as they do to plain FSDP2: Accelerate's own plugin objects (its
MixedPrecisionPolicy, built from mixed_precision, so bf16 all-gathers and compute; reshard_after_forward; the
CPUOffloadPolicy of fsdp_offload_params) are passed to fully_shard, as accelerate's fsdp2_prepare_model does.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import str_to_bool
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hfpar.parallel.sharding import carry_shard_specs, shard_spec

from .base import ModelParallelBackend, hfpar_reduced


class ModelParallelFSDP2(ModelParallelBackend):
    name = "model-parallel over FSDP2"
    short = "hfpar FSDP2"

    @classmethod
    def check(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        p = []
        # the launcher passes fsdp_offload_params as this variable; Accelerate's plugin reads the same one
        if str_to_bool(os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), to_bool=True):
            flags = " and ".join(f"--{k}_size {getattr(ctx, k)}" for k in ("tp", "ep", "cp") if getattr(ctx, k) > 1)
            p.append(f"fsdp_offload_params: true with {flags}: hfpar's TP / EP grad reductions and norm run on the "
                     "device, not on CPU-offloaded grads; set fsdp_offload_params: false (or use zero3_offload.yaml "
                     "without model parallelism)")
        if ctx.ep > 1 and mixed_precision == "fp16":
            # the experts stay outside FSDP2 (plain tensors) while the rest are DTensors: torch's GradScaler unscales
            # one optimizer's grads in a single foreach call, which refuses the mix (measured in a CPU fp16 launch)
            p.append(f"--ep_size {ctx.ep} with fsdp2 and fp16: the GradScaler cannot unscale the experts' grads "
                     "together with FSDP2's sharded ones; use bf16 (or ddp.yaml with fp16)")
        return p

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        mesh = self.ctx.dp_mesh(self.acc.device.type)
        specs = {n: shard_spec(p) for n, p in model.named_parameters() if shard_spec(p) is not None}
        ignored = {p for p in model.parameters() if hfpar_reduced(p)} or None
        layer_types = set(getattr(model, "_no_split_modules", None) or [])
        settings = fsdp2_settings(self.acc)
        for module in model.modules():  # one FSDP unit per decoder layer, as the fsdp2 config does
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh, ignored_params=ignored, **settings)
        fully_shard(model, mesh=mesh, ignored_params=ignored, **settings)
        carry_shard_specs(model, specs)
        return model


def fsdp2_settings(accelerator) -> dict:
    """fully_shard's keyword arguments from the accelerate config in effect: the FSDP plugin's own objects, as
    accelerate's fsdp2_prepare_model passes them (it sets the policy from mixed_precision when the state is made)."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if plugin is None:  # no FSDP config (a backend built by hand): fully_shard's defaults
        return {}
    return {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
