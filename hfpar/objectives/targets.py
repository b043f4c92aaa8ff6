"""The completion targets of an objective whose loss is a function of per-token log-probs of some positions only
(DPO's pairs, GRPO's completions): found once per micro-batch, and the LM head run on those positions alone.

    class MyObjective(TargetsHead, Objective):
        def __init__(self, model, ctx):
            self.init_targets_head(model, ctx)      # tp_group, scope = select_targets where the head allows it
        def __call__(self, out, labels):
            lp, t, logits = self.target_logps(out, labels)   # (N,) log-probs; t.index / t.token / t.seq; logits

Labels carry each target's sequence (hfpar.data.preference.decode_targets); Targets indexes with the flat positions
of one nonzero (one host sync a micro-batch), no boolean-mask indexing inside a forward. Under TP the log-probs come
from the vocab-parallel logit shards (never the full logits); without TP and without a pipeline the head computes
the targets' rows only (select_targets): prompts and padding never reach it, in forward or backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hfpar.data.preference import decode_targets
from hfpar.parallel.labels import IGNORE
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy


def token_logps(out: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """-cross-entropy per token (0 where IGNORE), fp32 at least. out (B, T, V) or its vocab shard (group)."""
    if group is not None:
        return -vocab_parallel_cross_entropy(out, target, group=group, reduction="none")
    logits = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    return -F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).reshape(target.shape)


class Targets:
    """The completion targets of a (planned) micro-batch's labels, found once per micro-batch (ONE host sync: the
    nonzero) and shared by its reference and policy forwards: flat positions `index` (N,), their tokens and
    sequences (DPO: 2 * pair + side; GRPO: 2 * row). Everything after it indexes with them: no boolean-mask indexing
    (each would be a host sync) inside a forward."""

    def __init__(self, labels: torch.Tensor):
        token, seq, valid = decode_targets(labels)
        self.labels, self.shape = labels, labels.shape
        self.index = valid.reshape(-1).nonzero().squeeze(1)
        self.token, self.seq = token.reshape(-1)[self.index], seq.reshape(-1)[self.index]

    def matches(self, labels: torch.Tensor) -> bool:
        return labels is self.labels


class TargetsHead:
    """Mixin of an Objective: the targets of a micro-batch (set `_plan` in before_micro) and the head on them."""

    def init_targets_head(self, model, ctx, under_tp: bool = False) -> None:
        """under_tp: the head on the targets also when it is vocab-parallel (a chunked head computes the targets'
        values from its shard's logits: hfpar.parallel.chunked_logps)."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        spec = shard_spec(head.weight) if head is not None else None
        self.tp_group = spec.group if spec is not None and spec.kind == "tp" and spec.sharded else None
        self._targets = None  # the Targets of the labels of a forward (select_targets)
        self._plan = None  # the current micro-batch's Targets (before_micro)
        self.scope = None  # the backend enters scope(labels) around a forward (hfpar.backends.base)
        if head is not None and (self.tp_group is None or under_tp) and ctx.pp == 1:
            head.register_forward_pre_hook(self._head_rows)
            self.scope = self.select_targets

    @contextlib.contextmanager
    def select_targets(self, labels: torch.Tensor):
        """Within: the LM head computes the logits of the completion targets' positions only, (1, N, V) in place
        of (B, T, V): prompts and padding never reach the head, in forward or backward. Not for a vocab-parallel
        head (its sequence-parallel input) nor a pipeline (its stages call the head)."""
        self._targets = self.targets(labels)
        try:
            yield
        finally:
            self._targets = None

    def _head_rows(self, module, args):
        x = args[0] if args else None
        if self._targets is None or x is None or x.shape[:-1] != self._targets.shape:
            return None
        return (x.reshape(-1, x.shape[-1]).index_select(0, self._targets.index).unsqueeze(0), *args[1:])

    def targets(self, labels: torch.Tensor) -> Targets:
        """The Targets of `labels`: the micro-batch's (found in before_micro) or found now (a pipeline's
        micro-batch, a slice of the batch's rows)."""
        return self._plan if self._plan is not None and self._plan.matches(labels) else Targets(labels)

    def target_logps(self, out: torch.Tensor, labels: torch.Tensor, logits: bool = False):
        """(N,) log-probs of the targets (differentiable), their Targets, and (N, V) their logits (or the vocab
        shard's) where `logits`, else None. `out`: the full logits (or their vocab shard), or the targets' rows
        only (select_targets)."""
        t = self.targets(labels)
        if out.shape[:-1] == labels.shape:
            token = torch.full_like(labels, IGNORE).reshape(-1).index_copy(0, t.index, t.token).view(labels.shape)
            lp = token_logps(out, token, self.tp_group).reshape(-1).index_select(0, t.index)
            flat = out.reshape(-1, out.shape[-1]).index_select(0, t.index) if logits else None
        else:  # the head computed the targets' logits only: (1, N, V), in labels' order
            flat = out.reshape(-1, out.shape[-1])
            lp = token_logps(flat, t.token, None)
        return lp, t, flat
