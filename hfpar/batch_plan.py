"""What happens to a collated batch before the forward, for every composition alike.

    plan = BatchPlan("lm", ctx, cp_mode="ring")
    batch, scope = plan(batch)             # on the device already
    with scope:                            # forward AND backward (activation checkpointing recomputes in backward)
        loss_sum, n = loss_fn(model(**inputs).logits, batch["labels"])

Causal LM: labels are shifted next to their inputs first (labels[t] = token t+1), so that a cut of the sequence
keeps every target with its input. Context parallelism: then this rank's part of every row (load-balanced
zigzag chunks, position ids made explicit), and a scope publishing the rows' layout to the attention.
"""

from __future__ import annotations

import contextlib

from hfpar.parallel.context_parallel import cp_rows, shard_batch, shift_labels


class BatchPlan:
    def __init__(self, task: str, ctx, cp_mode: str = "ring"):
        self.task, self.ctx, self.cp_mode = task, ctx, cp_mode

    def __call__(self, batch: dict) -> tuple[dict, contextlib.AbstractContextManager]:
        if self.task != "lm":
            return batch, contextlib.nullcontext()
        batch = shift_labels(batch)
        if self.ctx.cp == 1:
            return batch, contextlib.nullcontext()
        local, rows = shard_batch(batch, self.ctx.cp_rank, self.ctx.cp)
        return local, cp_rows(rows, self.ctx.cp_group, self.cp_mode)
