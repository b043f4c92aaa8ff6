"""Pipeline parallelism in your own loop: the loss_fn contract, the step's grads (tied embeddings, one norm over the
stages) and the trained model gathered back into one HF checkpoint.

    bounds = balanced_split(model, pp)                               # hfpar.parallel.pipeline
    stage = PipelineStage(model, pp_rank, bounds)                    # the model trimmed in place to its layers
    runner = PipelineRunner(stage, peers, schedule="1f1b", microbatches=2)
    tied = tied_embedding_group([peers])                             # collective; None unless embeddings are tied
    loss_sum, n = runner.train(batch, causal_lm_loss_fn, scale=1 / n_global)   # forward + backward, every stage
    norm = pipeline_clip_grad_norm_(stage, 1.0, tied_group=tied)     # tied grads summed, ONE norm over the stages
    save_pipeline_pretrained(stage, "out", peers)                    # collective: the merged HF checkpoint

The loss_fn contract: the runner calls `loss_fn(logits, labels)` on the LAST stage, once per micro-batch, with that
micro-batch's logits (b, T, V) and its rows of batch["labels"] as you passed them; it returns (loss_sum, n_targets),
the SUM of the per-token losses and how many targets it counted. The runner back-propagates loss_sum * scale (pass
scale = 1 / the real targets of the whole global batch for the global-token mean) and returns the step's
(loss_sum, n_targets) summed over micro-batches on every stage. causal_lm_loss_fn is HF's causal-LM loss in that
form (labels unshifted, -100 ignored, shifted inside).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.parallel.sharding import full_state_dict, grad_sq_norm, scale_grads_to_norm_

__all__ = ["causal_lm_loss_fn", "pipeline_clip_grad_norm_", "pipeline_state_dict", "save_pipeline_pretrained"]


def causal_lm_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the cross-entropy of every target, number of targets): labels (b, T) unshifted, -100 ignored."""
    targets = labels[:, 1:]  # position t predicts t + 1
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def pipeline_clip_grad_norm_(stage, max_norm: float, *, tied_group=None, pp_group=None) -> torch.Tensor:
    """After the step's backwards: the tied embedding's grad summed over its two copies (first and last stage), then
    the one global norm (the stages hold disjoint parameters: their squares add up; the tied weight counted once)
    and every stage clipped by it. Collective over the pipeline (pp_group: None = the world)."""
    if tied_group is not None:
        stage.sync_tied_grads(tied_group)
    params = list(stage.parameters())
    sq = grad_sq_norm([p for p in params if not (stage.is_last and p is stage.tied)])
    dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    scale_grads_to_norm_(params, norm, max_norm)
    return norm


def pipeline_state_dict(stage, peers: list[int], pp_group=None) -> dict[str, torch.Tensor] | None:
    """Collective: every stage's full tensors under the FULL model's names, merged on peers[0] (None elsewhere)."""
    mine = {stage.hf_name(k): v.detach().cpu() for k, v in full_state_dict(stage).items()}
    if stage.tied is not None and stage.is_last:  # a tied LM head is the first stage's embedding
        for name, p in stage.named_parameters(remove_duplicate=False):
            if p is stage.tied:
                mine.pop(stage.hf_name(name), None)
    parts = [None] * len(peers) if dist.get_rank() == peers[0] else None
    dist.gather_object(mine, parts, dst=peers[0], group=pp_group)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def save_pipeline_pretrained(stage, output_dir: str, peers: list[int], pp_group=None) -> None:
    """Collective: the merged model written by peers[0] as a normal HF checkpoint (from_pretrained loads it)."""
    full = pipeline_state_dict(stage, peers, pp_group)
    if full is not None:
        stage.save_pretrained(output_dir, state_dict=full, safe_serialization=True)
    dist.barrier(group=pp_group)
