"""What happens to a collated batch before the forward, for every composition alike.

    plan = BatchPlan("lm", ctx, cp_mode="ring")
    batch, scope = plan(batch)             # on the device already
    with scope:                            # forward AND backward (activation checkpointing recomputes in backward)
        loss_sum, n = loss_fn(model(**inputs).logits, batch["labels"])

Causal LM: labels are shifted next to their inputs first (labels[t] = token t+1), so that a cut of the sequence
keeps every target with its input. Context parallelism: then this rank's part of every row (load-balanced
zigzag chunks, position ids made explicit), and a scope publishing the rows' layout to the attention.
The scope also publishes the real tokens to MoE routers (padding takes no part in routing statistics, also when
activation checkpointing recomputes MoE layers in backward): the attention_mask of padded rows, or the token_mask
of packed and padding-free rows (which have no attention_mask; token_mask is no model input and leaves the batch).
Under pipeline parallelism the token mask stays in the batch instead: the schedule runs the rows in micro-batches
of its own and publishes each one's part around its forward and backward (hfpar.backends.pipeline).
"""

from __future__ import annotations

import contextlib

from hfpar.parallel.context_parallel import cp_rows, shard_batch, shift_labels
from hfpar.parallel.expert_parallel import moe_token_mask


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class BatchPlan:
    def __init__(self, task: str, ctx, cp_mode: str = "ring"):
        self.task, self.ctx, self.cp_mode = task, ctx, cp_mode

    def __call__(self, batch: dict) -> tuple[dict, contextlib.AbstractContextManager]:
        if self.task != "lm":
            return batch, contextlib.nullcontext()
        batch = shift_labels(batch)  # a new dict
        scope = contextlib.nullcontext()
        if self.ctx.cp > 1:
            batch, rows = shard_batch(batch, self.ctx.cp_rank, self.ctx.cp)
            scope = cp_rows(rows, self.ctx.cp_group, self.cp_mode)
        # real tokens, (B, T) or this rank's (B, T / cp): for MoE routers, in forward AND in the backward's recompute
        token_mask = batch.pop("token_mask", batch.get("attention_mask"))
        if token_mask is None:
            return batch, scope
        if self.ctx.pp > 1:  # the pipeline cuts the rows into micro-batches of its own, each routed with its part
            return {**batch, "token_mask": token_mask}, scope
        return batch, _both(scope, moe_token_mask(token_mask))
