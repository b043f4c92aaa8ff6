"""Context parallelism in your own loop: the batch cut for this cp rank with the label shift done once, by hfpar.

    model.set_attn_implementation(register_cp_attention())     # hfpar.parallel.context_parallel
    local, rows = cp_batch(batch, cp_rank, cp)                  # labels as HF expects them (unshifted)
    with cp_rows(rows, cp_group, "ring"):                       # or "ulysses"; forward AND backward inside
        loss = model(**local, num_items_in_batch=n).loss        # n: the real targets of the global batch
        loss.backward()
    # each cp rank's grads hold its tokens' part: SUM them over the cp group (with your data-parallel reduction)

Why the labels travel as `shift_labels`: a cut of the sequence must keep each target next to its input, so labels
are shifted BEFORE the cut; transformers' ForCausalLMLoss takes `shift_labels=` as already shifted and does not shift
again (it shifts `labels` only when no `shift_labels` is given). A double shift is therefore impossible through this
helper, and a batch that already carries `shift_labels` is refused (shifted once by you, or twice).
"""

from __future__ import annotations

import torch

from hfpar.parallel.context_parallel import shard_batch, shift_labels

__all__ = ["count_targets", "cp_batch"]


def cp_batch(batch: dict, cp_rank: int, cp: int) -> tuple[dict, object]:
    """(this rank's zigzag part of every (B, T) tensor, the RowLayout for cp_rows). `batch` holds input_ids,
    attention_mask / position_ids as usual and HF's unshifted `labels` (-100 = ignored). The local batch has explicit
    position_ids; padding and packed documents are in the RowLayout the attention reads."""
    if "shift_labels" in batch:
        raise ValueError(
            "cp_batch: the batch already has shift_labels; pass HF's unshifted labels only (hfpar shifts "
            "them once, before the cut)"
        )
    if "labels" not in batch:
        raise ValueError("cp_batch: the batch has no labels (HF's unshifted labels, -100 = ignored)")
    shifted = shift_labels(batch)["labels"]  # (B, T): the target of each position, with it
    local, rows = shard_batch({**batch, "shift_labels": shifted}, cp_rank, cp)
    local["labels"] = local["shift_labels"]  # HF computes a loss only when labels are given
    return local, rows


def count_targets(batch: dict) -> torch.Tensor:
    """The real targets of a FULL (uncut) batch with unshifted labels: num_items_in_batch for the global-token mean."""
    return (batch["labels"][:, 1:] != -100).sum()
