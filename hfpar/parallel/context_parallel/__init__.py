"""Context parallelism: the sequence of every row sharded over the cp ranks, attention exact over the whole row.

    layout.py     load-balanced (zigzag) cut of a batch, labels shifted before it, documents from position ids
    attention.py  ring (all-gather form) and Ulysses (all-to-all) attention, registered as "hfpar_cp"
"""

from .attention import MODES, cp_attention_forward, cp_rows, register_cp_attention, ring_attention, ulysses_attention
from .layout import RowLayout, document_ids, shard_batch, shift_labels, zigzag_indices

__all__ = ["MODES", "cp_attention_forward", "cp_rows", "register_cp_attention", "ring_attention", "ulysses_attention",
           "RowLayout", "document_ids", "shard_batch", "shift_labels", "zigzag_indices"]
