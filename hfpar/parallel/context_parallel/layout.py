"""How a batch is cut along the sequence over the cp ranks (load-balanced), and the row facts attention needs.

    batch = shift_labels(batch)                        # targets aligned with their inputs BEFORE any cut
    local, rows = shard_batch(batch, cp_rank, cp)      # this rank's tokens; rows: doc ids + global indices

Load balancing for causal attention: a row of T tokens (T a multiple of 2 cp) is cut into 2 cp chunks and
rank r holds chunks r and 2 cp - 1 - r, so every rank holds as many early (cheap) as late (expensive) queries.

Documents of a packed row come from the position ids: a document starts where the position id does not
continue the previous one (0, or any jump). Padding (attention_mask 0) gets document id -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..labels import IGNORE


@dataclass
class RowLayout:
    """What every cp rank knows about the full rows of the current batch (small integer tensors)."""

    doc: torch.Tensor  # (B, T) document id per global position, -1 for padding
    order: torch.Tensor  # (T,) global position of each token in cp-gathered order (rank 0's tokens first)
    local: torch.Tensor  # (T / cp,) global positions this rank holds, in its local order
    cp: int
    causal: bool = False  # every row is one document without padding: plain causal attention suffices
    tops: torch.Tensor | None = None  # (B,) largest position id of each whole row (dynamic rotary: rotary.py)
    positions: torch.Tensor | None = None  # (B, T) position id per global position (chunked attention: chunked)
    cache: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # kernel calls (fused.row_calls), docs, layouts

    def row_slice(self, start: int, stop: int) -> RowLayout:
        """The layout of rows start:stop only (a pipeline micro-batch), made once per batch."""
        key = ("rows", start, stop)
        if key not in self.cache:
            tops, pos = (None if t is None else t[start:stop] for t in (self.tops, self.positions))
            self.cache[key] = self._with(self.doc[start:stop], tops, pos)
        return self.cache[key]

    def chunked(self, chunk: int) -> RowLayout:
        """The layout a chunked-attention layer sees (transformers' `chunked_attention` layer type, Llama 4): a token
        attends within its document and its chunk of `chunk` positions (masking_utils.chunked_overlay, on the position
        ids as its packed-sequence remap puts it): a new document wherever a position id is a multiple of `chunk`.
        Made once per batch and chunk size."""
        key = ("chunked", chunk)
        if key not in self.cache:
            if self.positions is None:
                raise ValueError("context parallelism: a chunked-attention layer needs the rows' position ids")
            starts = torch.ones_like(self.doc, dtype=torch.bool)
            starts[:, 1:] = (self.doc[:, 1:] != self.doc[:, :-1]) | (self.positions[:, 1:] % chunk == 0)
            doc = starts.long().cumsum(dim=1).masked_fill(self.doc < 0, -1)
            self.cache[key] = self._with(doc, self.tops, self.positions)
        return self.cache[key]

    def _with(self, doc: torch.Tensor, tops, positions) -> RowLayout:
        """The same cut (order, local, cp) over other rows or documents."""
        return RowLayout(
            doc, self.order, self.local, self.cp, causal=_one_document(doc), tops=tops, positions=positions
        )

    def doc_lists(self) -> list[list[int]]:
        """rows.doc as Python lists (made once per batch, for the kernel calls)."""
        if "docs" not in self.cache:
            self.cache["docs"] = self.doc.tolist()
        return self.cache["docs"]


def _one_document(doc: torch.Tensor) -> bool:
    """Every row one document without padding: plain causal attention suffices (RowLayout.causal)."""
    return bool((doc == doc[:, :1]).all()) and bool((doc >= 0).all())


def zigzag_indices(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks r and 2cp-1-r of 2cp equal chunks. (T / cp,)"""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not a multiple of 2 x cp_size = {2 * cp}; "
            "pad rows to a multiple of it (the collator does, given pad_to_multiple_of)"
        )
    c = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)]
    )


def gathered_order(seq_len: int, cp: int) -> torch.Tensor:
    """Global positions in the order an all-gather over the cp group concatenates the ranks' tokens. (T,)"""
    return torch.cat([zigzag_indices(seq_len, r, cp) for r in range(cp)])


def document_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) -> (B, T) id of the document each token belongs to (a new one wherever the position ids do not
    continue the previous token's); -1 where attention_mask is 0."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = starts.long().cumsum(dim=1)
    if attention_mask is not None:
        doc = doc.masked_fill(attention_mask == 0, -1)
    return doc


def default_position_ids(batch: dict) -> torch.Tensor:
    """The position ids HF models use when none are given: 0..T-1 per row (padding on the right only)."""
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).clone()


def shift_labels(batch: dict) -> dict:
    """labels[t] <- labels[t + 1] (IGNORE at the end): the target of each position sits with it, so a cut of the
    sequence keeps every target next to its input (no target lost at a shard edge)."""
    labels = batch["labels"]
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    return {**batch, "labels": shifted}


def shard_batch(batch: dict, cp_rank: int, cp: int) -> tuple[dict, RowLayout]:
    """This rank's part of every per-token tensor of `batch` (B, T) -> (B, T / cp), with position ids made
    explicit, and the RowLayout of the full rows. Labels must already be shifted (shift_labels)."""
    ids = batch["input_ids"]
    seq_len = ids.shape[1]
    pos = batch.get("position_ids")
    pos = default_position_ids(batch) if pos is None else pos
    mask = batch.get("attention_mask")
    local = zigzag_indices(seq_len, cp_rank, cp).to(ids.device)
    out = {}
    for k, v in {**batch, "position_ids": pos}.items():
        out[k] = v[:, local] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == seq_len else v
    doc = document_ids(pos, mask)
    rows = RowLayout(
        doc=doc,
        order=gathered_order(seq_len, cp).to(ids.device),
        local=local,
        cp=cp,
        causal=_one_document(doc),
        tops=pos.amax(dim=1),
        positions=pos,
    )
    return out, rows
