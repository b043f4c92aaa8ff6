"""Model parallelism (TP, EP, TP x EP, TP x CP) over DeepSpeed ZeRO-3: ZeRO partitions each rank's tensors (its TP
shards, its experts) among the ranks holding the same ones, never across different ones.

    backend = ModelParallelZeRO3(accelerator, ctx, "zero3", args); backend.prepare(model)

TP: as under ZeRO-1/2 (mp_deepspeed.py), DeepSpeed gets hfpar's mpu (zero.DeepSpeedMPU): ZeRO-3 partitions,
all-gathers (before each module's forward) and reduce-scatters over the dp group, so every TP shard is partitioned
among the dp ranks of its TP coordinate; its grad norm sums the TP-sharded parameters (tensor_model_parallel) over
TP and counts the replicated ones on TP rank 0. Partial grads (SP norms) are summed over TP by backward hooks.

EP: DeepSpeed's ZeRO-3 partitions a parameter over the group named by its `ds_zero_partition_process_group`
(read when it converts the parameter at initialize; its own AutoEP experts use it), and its stage-3 optimizer
treats parameters tagged `ds_zero_placement_family = "autoep_expert"` as expert shards: grads reduce-scattered
over that group and averaged over the whole dp group (hfpar's expert rule: SUM over the expert-dp group / dp), and
the norm of their sub-group summed over the partition group, then over the expert-parallel group it looks up by
`ds_zero_partition_group_name` in deepspeed.utils.groups, counted on every TP rank once. hfpar's experts get these
attributes, naming its expert-dp group (the ranks holding the same experts) and its EP group (registered under
DeepSpeed's own name "ep_size_<ep>"), so DeepSpeed's optimizer, clipping and checkpoints hold them with the dense
parameters (no optimizer of hfpar's own, unlike ZeRO-1/2). Two things are put right around it:
  - DeepSpeed broadcasts every parameter from dp rank 0 at initialize (the model was not built under zero.Init),
    before it partitions them: the experts are put back through GatheredParameters(modifier_rank=0), which
    re-partitions them from the first rank of each expert-dp group;
  - ZeRO-3's own consolidated state dict fills global rank 0 only and gathers over the dp group alone: the export
    gathers each parameter over its own partition group (GatheredParameters) on every rank, then hfpar gathers the
    TP shards and the experts over TP / EP (their ShardSpec).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpar.parallel.guard import release
from hfpar.parallel.sharding import full_state_dict, partial_grad_hooks, shard_spec

from .base import Backend, hfpar_reduced
from .mp_deepspeed import ModelParallelDeepSpeed
from .optim import build_optimizer
from .zero import DeepSpeedMPU, deepspeed_with_mpu

EXPERT_FAMILY = "autoep_expert"  # DeepSpeed's placement family of expert shards (stage3.py, engine.py)


class ModelParallelZeRO3(ModelParallelDeepSpeed):
    name = "model-parallel over DeepSpeed ZeRO-3"
    short = "hfpar + DeepSpeed"

    @classmethod
    def problems(cls, args, ctx, strategy: str, mixed_precision: str) -> list[str]:
        p = []
        if mixed_precision == "fp16":
            flags = " and ".join(f"--{k}_size {getattr(ctx, k)}" for k in ("tp", "ep", "cp") if getattr(ctx, k) > 1)
            p.append(
                f"{flags} with {strategy} and fp16: DeepSpeed's fp16 loss scaling is not verified with hfpar's "
                "model parallelism; use bf16 (or ddp.yaml / fsdp2.yaml, where hfpar unscales fp16 itself)"
            )
        return p

    def prepare(self, model) -> None:
        experts = [p for p in model.parameters() if hfpar_reduced(p)]
        self.base_optimizer = build_optimizer(model, self.args)  # experts too: DeepSpeed partitions and steps them
        partial_grad_hooks(model.parameters())  # a no-op without partial grads
        saved = [p.detach().clone() for p in experts]
        if experts:
            place_experts(experts, self.ctx)
        mpu = DeepSpeedMPU(self.ctx.tp_group, self.ctx.replica_group) if self.ctx.tp > 1 else None
        release(model)  # the refusal apply_* armed (hfpar.parallel.guard): this DeepSpeed wrap spans the dp group only
        with deepspeed_with_mpu(mpu):
            self.model, self.optimizer = self.acc.prepare(model, self.base_optimizer)
        # none for ModelParallelDeepSpeed's expert optimizer: clip() is then DeepSpeed's norm (dense + experts, both
        # clipped in its step), step() / zero_grad() / the rank-state files are DeepSpeed's alone
        self.experts = []
        if experts:
            put_back(experts, saved)

    def full_state_dict(self) -> dict:
        # every parameter partitioned first: GatheredParameters all-gathers only the partitioned ones, and which ones
        # ZeRO-3 keeps gathered after a forward is each rank's own bookkeeping; this way every rank gathers the same
        self.model.empty_partition_cache()
        model = self.unwrapped()
        return full_state_dict(model, base=partition_gathered_state(model))


def place_experts(experts: list[torch.Tensor], ctx) -> None:
    """Tag the expert parameters so ZeRO-3 partitions them over the expert-dp group (the ranks holding the same
    experts) with DeepSpeed's expert semantics, and register hfpar's EP / expert-dp groups where DeepSpeed looks
    them up. Before deepspeed.initialize (it reads the tags when it converts the parameters)."""
    # here, not at the top: DeepSpeed is an optional dependency (hfpar[deepspeed]), as in zero.py
    from deepspeed.utils import groups  # noqa: PLC0415

    name = f"ep_size_{ctx.ep}"  # DeepSpeed's naming: its helpers parse the ep size out of the name
    ep_group, edp_group = ctx.ep_group, ctx.edp_group
    # DeepSpeed has no public call registering existing groups (its own creator builds new ones from its rank layout,
    # which need not be hfpar's): the four dicts its lookups read
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(edp_group)
    dp = dist.get_world_size(ctx.replica_group if ctx.tp > 1 else None)  # the group DeepSpeed averages experts over
    for p in experts:
        spec = shard_spec(p)
        if spec.dp_size != dp:  # hfpar's rule is SUM over expert-dp / dp_size; DeepSpeed's divides by its dp
            raise RuntimeError(f"expert parameter {tuple(p.shape)}: dp size {spec.dp_size} is not DeepSpeed's {dp}")
        p.ds_zero_placement_family = EXPERT_FAMILY
        p.ds_zero_partition_group_name = name
        p.ds_zero_partition_process_group = edp_group


def put_back(experts: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    """Collective: each rank's experts (overwritten by DeepSpeed's broadcast from rank 0) set again and
    re-partitioned; every rank of an expert-dp group holds the same ones, so its first rank's copy is right."""
    from deepspeed.runtime.zero import GatheredParameters  # noqa: PLC0415  (optional dependency, as above)

    with GatheredParameters(experts, modifier_rank=0), torch.no_grad():
        for p, s in zip(experts, saved):
            p.data.copy_(s.to(p.device, p.dtype))


@torch.no_grad()
def partition_gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank's own tensors (its TP shards, its experts) under state-dict names, each parameter
    gathered over its ZeRO-3 partition group one module at a time (tied parameters once)."""
    from deepspeed.runtime.zero import GatheredParameters  # noqa: PLC0415  (optional dependency, as above)

    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        with GatheredParameters([p for _, p in params]):
            for name, p in params:
                if id(p) not in done:
                    done[id(p)] = p.data.detach().clone()
                out[f"{prefix}.{name}" if prefix else name] = done[id(p)]
    return out


__all__ = ["Backend", "ModelParallelZeRO3", "partition_gathered_state", "place_experts", "put_back"]
