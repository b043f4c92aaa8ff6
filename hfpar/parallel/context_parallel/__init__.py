"""Context parallelism: the sequence of every row sharded over the cp ranks, attention exact over the whole row.

    layout.py     load-balanced (zigzag) cut of a batch, labels shifted before it, documents from position ids
    attention.py  ring (all-gather form) and Ulysses (all-to-all) attention, registered as "hfpar_cp"
    blockwise.py  exact document-causal attention by blocks with the log-sum-exp merge (flash attention's memory)
"""

from .attention import MODES, cp_attention_forward, cp_rows, register_cp_attention, ring_attention, ulysses_attention
from .blockwise import block_attention, doc_causal_mask
from .layout import RowLayout, document_ids, shard_batch, shift_labels, zigzag_indices

__all__ = ["block_attention", "doc_causal_mask", "MODES", "cp_attention_forward", "cp_rows", "register_cp_attention", "ring_attention", "ulysses_attention",
           "RowLayout", "document_ids", "shard_batch", "shift_labels", "zigzag_indices"]
