"""Per-batch loss SUMS and target counts, so the trainer can normalize by the real tokens of the global batch.

    loss_fn = make_loss_fn("lm", model)          # vocab-parallel when the model's LM head is TP-sharded
    loss_sum, n_targets = loss_fn(logits, shifted_labels)   # the trainer shifts causal-LM labels first (BatchPlan)

lm_loss_sum / tp_lm_loss_sum take HF's unshifted labels (the shift inside), for users' own loops.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from hfpar.parallel.chunked_loss import chunked_loss_state
from hfpar.parallel.labels import IGNORE
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in at least fp32 (bf16 logits lose too much in log-softmax)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def shifted_lm_loss_sum(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over real targets; target[t] is the token after position t. logits (B, T, V)."""
    logits = _upcast(logits)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, (target != IGNORE).sum()


def shifted_tp_lm_loss_sum(
    logits_shard: torch.Tensor, target: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """As shifted_lm_loss_sum, from vocab-parallel logit shards (B, T, V/tp): the full vocab is never gathered."""
    loss = vocab_parallel_cross_entropy(logits_shard, target, group=group, ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over real targets. logits (B, T, V), labels (B, T) unshifted."""
    return shifted_lm_loss_sum(logits[:, :-1, :], labels[:, 1:])


def tp_lm_loss_sum(logits_shard: torch.Tensor, labels: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """As lm_loss_sum, from vocab-parallel logit shards (B, T, V/tp)."""
    return shifted_tp_lm_loss_sum(logits_shard[:, :-1, :], labels[:, 1:], group)


def classify_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, C), labels (B,) with IGNORE for padding slots."""
    loss = F.cross_entropy(_upcast(logits), labels, ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


class ChunkedLMLoss:
    """The loss of a model whose LM head computes it chunk by chunk (hfpar.parallel.chunked_loss): forward runs inside
    `scope(shifted_labels)`, and the "logits" it returns are the loss sum."""

    def __init__(self, state):
        self.scope = state.targets

    def __call__(self, loss_sum: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum.reshape(()), (target != IGNORE).sum()


def make_loss_fn(task: str, model: torch.nn.Module):
    """The loss for the task (causal LM: on labels already shifted, see hfpar.train.batch_plan): the head's chunked loss
    where installed; for a causal LM whose output embedding is vocab-sharded (its ShardSpec), the vocab-parallel
    one over that shard's group."""
    if task != "lm":
        return classify_loss_sum
    state = chunked_loss_state(model)
    if state is not None:
        return ChunkedLMLoss(state)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    spec = shard_spec(head.weight) if head is not None else None
    if spec is not None and spec.kind == "tp" and spec.sharded:
        return partial(shifted_tp_lm_loss_sum, group=spec.group)
    return shifted_lm_loss_sum


def count_targets(batch: dict) -> int:
    """Real targets of a batch whose labels are aligned with their positions (shifted for causal LMs)."""
    return int((batch["labels"] != IGNORE).sum())
