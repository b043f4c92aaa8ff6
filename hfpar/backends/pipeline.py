"""Pipeline parallelism over data parallelism: each rank holds one stage, hfpar reduces its grads over dp.

    backend = PipelineDDP(accelerator, ctx, "ddp", args); backend.prepare(stage)   # stage: a PipelineStage
    loss_sum = backend.train_micro(batch, scope, loss_fn, scale)                     # the pipeline schedule

The forward and backward of an accumulation step's rows are the schedule's (PipelineRunner, GPipe or 1F1B), not
one model call: the backend owns them. Grads of a stage are averaged over the ranks holding the same stage (dp x
cp) by hfpar's bucketed all-reduce once per optimizer step (ShardSpec.dp_reduce_group), not by a DDP wrapper:
the schedule runs several backwards per step whose order differs between stages, and one reduction at the end is
what DDP's no_sync would leave anyway. The grad norm sums every stage's squares over the pipeline group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfpar import checkpoint as ckpt
from hfpar.parallel.expert_parallel import set_aux_loss_loss_scale
from hfpar.parallel.pipeline import PipelineRunner, microbatches, tied_embedding_group
from hfpar.parallel.sharding import (full_state_dict, grad_sq_norm, reduce_dp_grads, scale_grads_to_norm_, set_shard_spec,
                                     sync_partial_grads)

from .base import ModelParallelBackend
from .loss_scale import unscale_


class PipelineDDP(ModelParallelBackend):
    name = "pipeline over data parallelism"
    short = "hfpar pipeline"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.ctx.grad_replicas > 1:
            for p in model.parameters():
                set_shard_spec(p, dp_reduce_group=self.ctx.replica_group, dp_size=self.ctx.grad_replicas)
        # every rank joins the collective group creation; the first and last stage of each pipeline get theirs
        self.tied_group = tied_embedding_group(self.ctx.rank_lists("pp")) if model.ties_embeddings else None
        self.runner = PipelineRunner(model, self.ctx.pp_peers, self.args.pp_schedule, microbatches(self.args),
                                     group=self.ctx.pp_group)
        return model

    def train_micro(self, batch: dict, scope, loss_fn, scale: float, task: str = "lm") -> torch.Tensor:
        # fp16: the schedule runs its own backwards, so the loss scale goes into the back-propagated factor
        set_aux_loss_loss_scale(self.loss_scale())
        with scope, self.autocast():
            loss_sum, _ = self.runner.train(batch, loss_fn, scale * self.loss_scale())
        return loss_sum

    def eval_loss(self, batch: dict, scope, loss_fn, task: str = "lm"):
        with scope, self.autocast():
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
        dist.all_reduce(sq, group=self.ctx.pp_group)   # stages hold disjoint parameters: the squares add up
        norm = sq.sqrt()
        scale_grads_to_norm_(params, norm, max_norm)
        return float(norm)

    def _rank_file(self, ckpt_dir):
        return ckpt.rank_state_file(ckpt_dir, self.ctx), True

    def full_state_dict(self) -> dict:
        """Collective: every stage's full tensors under the full model's names, merged on the pipeline's first
        rank (the main process writes them); other ranks get their own stage's."""
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
