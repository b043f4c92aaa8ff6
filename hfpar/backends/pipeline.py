"""Pipeline parallelism over data parallelism: each rank holds one stage (tensor-parallel under --tp_size), its
grads reduced over the ranks holding the same stage by hfpar (PipelineDDP: the HfparAllReduce wrap component) or by
FSDP2 (PipelineFSDP2: the FullyShard component, wraps.py); PipelineBackend runs the schedule for both.

    backend = PipelineDDP(accelerator, ctx, "ddp", args); backend.prepare(stage)   # stage: a PipelineStage
    loss_sum = backend.train_micro(batch, scope, loss_fn, scale)                     # the pipeline schedule

The forward and backward of an accumulation step's rows are the schedule's (PipelineRunner, GPipe or 1F1B), not
one model call: the backend owns them. Grads of a stage are averaged over the ranks holding the same stage (dp x
cp) by hfpar's bucketed all-reduce once per optimizer step (ShardSpec.dp_reduce_group), not by a DDP wrapper:
the schedule runs several backwards per step whose order differs between stages, and one reduction at the end is
what DDP's no_sync would leave anyway. The grad norm sums every stage's squares over the pipeline group (each
stage's own squares already count its TP shards once, ShardSpec). Under TP the pipeline group of a rank joins the
ranks of the same tp coordinate, so boundary activations travel between matching TP shards. PipelineFSDP2 shards
each stage over its dp group instead (fully_shard per decoder layer, as ModelParallelFSDP2): FSDP2's reduce-scatter
of every backward replaces hfpar's dp average.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hfpar.checkpoint.layout import rank_state_file
from hfpar.parallel.context_parallel import cp_row_slice
from hfpar.parallel.expert_parallel import moe_token_mask, set_aux_loss_loss_scale
from hfpar.parallel.pipeline import PipelineRunner, tied_embedding_group
from hfpar.parallel.sharding import (
    full_state_dict,
    grad_sq_norm,
    reduce_dp_grads,
    scale_grads_to_norm_,
    sync_partial_grads,
)

from .base import hfpar_reduced
from .loss_scale import unscale_
from .model_parallel import ModelParallelBackend
from .wraps import FullyShard, HfparAllReduce


@contextlib.contextmanager
def micro_scope(i: int, mb: dict):
    """Around micro-batch i's forward and backward: its rows' real tokens for MoE routers (routing statistics per
    micro-batch), and under context parallelism its rows' layout (the trainer's scope publishes the whole batch's)."""
    rows = mb["input_ids"].shape[0]
    mask = mb.get("token_mask", mb.get("attention_mask"))
    with moe_token_mask(mask) if mask is not None else contextlib.nullcontext(), cp_row_slice(i * rows, (i + 1) * rows):
        yield


class PipelineBackend(ModelParallelBackend):
    """The schedule's forward / backward, the grad norm over the stages, the export merged over the pipeline;
    the data-parallel wrap of the stage is the `data_parallel` component's."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self.dp_wrap.wrap(
            self.acc,
            self.ctx,
            model,
            layer_types=set(getattr(getattr(model, "lm", None), "_no_split_modules", None) or []),
            ignored=[p for p in model.parameters() if hfpar_reduced(p)],
        )  # experts (EP)
        if self.dp_wrap.prepends_hooks and not model.is_first:  # FSDP2 prepended its own pre-hook to the first
            model.hook_first_layer()  # layer: ours must run before it
        return self._pipeline(model)

    def _pipeline(self, model: torch.nn.Module) -> torch.nn.Module:
        # every rank joins the collective group creation; the first and last stage of each pipeline get theirs
        self.tied_group = tied_embedding_group(self.ctx.rank_lists("pp")) if model.ties_embeddings else None
        a = self.args
        self.runner = PipelineRunner(
            model,
            self.ctx.pp_peers,
            a.pp_schedule,
            self.run_plan.microbatches,
            group=self.ctx.pp_group,
            autocast=self.autocast,
            micro_scope=micro_scope,
        )
        return model

    def train_micro(self, batch: dict, scope, loss_fn, scale: float, task: str = "lm") -> torch.Tensor:
        # fp16: the schedule runs its own backwards, so the loss scale goes into the back-propagated factor
        loss_scale = self.loss_scale()  # one read (GradScaler.get_scale syncs with the device)
        set_aux_loss_loss_scale(loss_scale)
        with scope:  # the runner autocasts each forward
            loss_sum, _ = self.runner.train(batch, loss_fn, scale * loss_scale)
        return loss_sum

    def eval_loss(self, batch: dict, scope, loss_fn, task: str = "lm"):
        with scope:
            loss_sum, n = self.runner.evaluate(batch, loss_fn)
        return loss_sum, n, None

    def clip(self, max_norm: float) -> float:
        stage = self.unwrapped()
        params = list(self.model.parameters())
        sync_partial_grads(params)
        reduce_dp_grads(params)
        if self.tied_group is not None:
            stage.sync_tied_grads(self.tied_group)
        unscale_(self.scaler, self.optimizer)  # fp16: the true grads before the norm; found-inf over the world
        # a tied embedding is one parameter of the model: its square counted on the first stage only
        sq = grad_sq_norm([p for p in params if not (stage.is_last and p is stage.tied)])
        dist.all_reduce(sq, group=self.ctx.pp_group)  # stages hold disjoint parameters: the squares add up
        norm = sq.sqrt()
        scale_grads_to_norm_(params, norm, max_norm)
        return float(norm)

    def _rank_file(self, ckpt_dir):
        return rank_state_file(ckpt_dir, self.ctx), True

    def hf_name(self, key: str) -> str:
        return self.unwrapped().hf_name(key.removeprefix("module."))  # the stage's layer indices made global

    def hf_model(self) -> torch.nn.Module:
        """What writes the export: the stage (a full-config model on the meta device), or the PEFT model."""
        stage = self.unwrapped()
        return stage.peft_model if stage.peft_model is not None else stage

    def full_state_dict(self) -> dict:
        """Collective: every stage's full tensors (TP shards gathered within the stage, FSDP2 shards over its dp
        group) under the full model's names (the PEFT model's under LoRA), merged on the pipeline's first rank (the
        main process writes them); other ranks get their own stage's."""
        stage = self.unwrapped()
        mine = {stage.hf_name(k): v.cpu() for k, v in full_state_dict(stage).items()}
        if stage.tied is not None and stage.is_last:  # a tied LM head is saved once, as the first stage's embedding
            for name, p in stage.named_parameters(remove_duplicate=False):
                if p is stage.tied:
                    mine.pop(stage.hf_name(name), None)
        peers = self.ctx.pp_peers
        parts = [None] * len(peers) if self.ctx.rank == peers[0] else None
        dist.gather_object(mine, parts, dst=peers[0], group=self.ctx.pp_group)
        if parts is None:
            return mine
        return {k: v for part in parts for k, v in part.items()}


class PipelineDDP(PipelineBackend):
    name = "pipeline over data parallelism"
    short = "hfpar pipeline"
    data_parallel = HfparAllReduce


class PipelineFSDP2(PipelineBackend):
    name = "pipeline over FSDP2"
    short = "hfpar pipeline FSDP2"
    data_parallel = FullyShard  # the config's mixed-precision policy, resharding (offload refused by its check)
