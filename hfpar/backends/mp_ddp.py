"""Model parallelism (TP, EP) over DDP: DistributedDataParallel over the dp (x cp) group only.

    backend = ModelParallelDDP(accelerator, ctx, "ddp", args); backend.prepare(tp_model)

Why by hand: Accelerate's DDP reduces over the whole world, which would average different TP shards
(and different experts) together. Experts are left out of DDP (ranks hold different ones, and DDP
would broadcast rank 0's at wrap time); hfpar reduces their grads over the ranks holding the same ones.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import ModelParallelBackend, hfpar_reduced


class ModelParallelDDP(ModelParallelBackend):
    name = "model-parallel over DDP"
    short = "hfpar DDP"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.ctx.grad_replicas == 1:
            return model
        ignored = [n for n, p in model.named_parameters() if hfpar_reduced(p)]
        if ignored:
            DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
        dev = [self.acc.device.index] if self.acc.device.type == "cuda" else None
        return DDP(model, process_group=self.ctx.replica_group, device_ids=dev)
