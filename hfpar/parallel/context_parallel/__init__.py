"""Context parallelism: the sequence of every row sharded over the cp ranks, attention exact over the whole row.

layout.py     load-balanced (zigzag) cut of a batch, labels shifted before it, documents from position ids
attention.py  ring and Ulysses (all-to-all) attention, registered as "hfpar_cp"
ring.py       the overlapped ring: K / V pieces passed by batched isend / irecv while a piece is computed
fused.py      attention through the device's fused kernel per block, merged by log-sum-exp (kernels.py)
kernel_calls.py  which kernel calls (no mask / causal / window mask) cover a block's documents
probe.py      whether a model's attention goes through transformers' registry (the preflight's CP check)
mixing.py     what else mixes tokens (Mamba, linear attention, convolutions); gathered.py runs those on whole rows
shard_check.py  whether the tiny copy cut over emulated ranks agrees
enable.py     a model's attention switched to CP's (checked) and back (whole_sequence)
blockwise.py  exact document-causal attention by blocks in torch ops: reference, softcap fallback, all-gather
"""

from ..exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".attention": (
            "MODES",
            "cp_attention_forward",
            "cp_row_slice",
            "cp_rows",
            "register_cp_attention",
            "ring_attention",
            "ulysses_attention",
        ),
        ".blockwise": (
            "block_attention",
            "doc_causal_mask",
        ),
        ".enable": (
            "enable_cp_attention",
            "whole_sequence",
        ),
        ".layout": (
            "RowLayout",
            "document_ids",
            "shard_batch",
            "shift_labels",
            "zigzag_indices",
        ),
    },
)
