"""What the pipeline publishes around each micro-batch's forward and backward (hfpar.backends.pipeline.micro_scope):
its rows' real-token mask for MoE routers, and under context parallelism its rows' layout, equal to what the batch
plan would publish for those rows alone (every rank's part of the sequence, packed documents, padding)."""

from __future__ import annotations

import torch

from hfpar.backends.pipeline import micro_scope
from hfpar.parallel.context_parallel import (
    attention,
    cp_rows,
    shard_batch,
    shift_labels,
)
from hfpar.parallel.expert_parallel.router import current_token_mask
from hfpar.parallel.pipeline import split_microbatches


def _batch() -> dict:
    """4 rows of 8: packed documents in row 0, right padding in row 3 (the only row not one plain document)."""
    ids = torch.arange(32).view(4, 8) % 13 + 3
    pos = torch.arange(8).repeat(4, 1)
    pos[0] = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[3, 5:] = 0
    return shift_labels({"input_ids": ids, "position_ids": pos, "attention_mask": mask, "labels": ids.clone()})


def test_each_micro_batch_gets_its_rows_layout_and_token_mask():
    batch = _batch()
    for cp_rank in range(2):
        local, rows = shard_batch(batch, cp_rank, 2)
        local = {**local, "token_mask": local["attention_mask"]}
        with cp_rows(rows, None, "ring"):
            for i, mb in enumerate(split_microbatches(local, 2)):
                _, alone = shard_batch({k: v[2 * i : 2 * i + 2] for k, v in batch.items()}, cp_rank, 2)
                with micro_scope(i, mb):
                    got, group, mode = attention._state.cur
                    assert torch.equal(current_token_mask(), mb["token_mask"])
                    assert torch.equal(got.doc, alone.doc) and got.causal == alone.causal
                    assert torch.equal(got.local, alone.local) and torch.equal(got.order, alone.order)
                    assert (group, mode) == (None, "ring")
                assert attention._state.cur[0] is rows and current_token_mask() is None
            assert rows.row_slice(0, 2) is rows.row_slice(0, 2)  # made once per batch (forward and backward share it)
    assert [rows.row_slice(2 * i, 2 * i + 2).causal for i in range(2)] == [False, False]
    assert rows.row_slice(1, 3).causal  # rows 1 and 2: one unpadded document each


def test_without_context_parallelism_only_the_mask():
    mb = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    with micro_scope(1, mb):
        assert torch.equal(current_token_mask(), mb["attention_mask"])
        assert getattr(attention._state, "cur", None) is None
