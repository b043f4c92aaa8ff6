"""Model parallelism (TP, EP) over FSDP2: `fully_shard` on a 1-D mesh of the dp group (2-D: dp x tp).

    backend = ModelParallelFSDP2(accelerator, ctx, "fsdp2", args); backend.prepare(tp_model)

Why by hand: Accelerate's FSDP2 path shards over one mesh of the whole world, which would mix different
TP shards; here parameters become DTensors sharded over dp only, and every TP rank of a replica shards
its own TP shard of them. Experts are ignored by FSDP (sharded by EP already, reduced by hfpar).
FSDP2 replaces the Parameter objects: their ShardSpecs are carried over by name.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from hfpar.parallel.sharding import carry_shard_specs, shard_spec

from .base import ModelParallelBackend, hfpar_reduced


class ModelParallelFSDP2(ModelParallelBackend):
    name = "model-parallel over FSDP2"
    short = "hfpar FSDP2"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        mesh = self.ctx.dp_mesh(self.acc.device.type)
        specs = {n: shard_spec(p) for n, p in model.named_parameters() if shard_spec(p) is not None}
        ignored = {p for p in model.parameters() if hfpar_reduced(p)} or None
        layer_types = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():  # one FSDP unit per decoder layer, as the fsdp2 config does
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
        carry_shard_specs(model, specs)
        return model
