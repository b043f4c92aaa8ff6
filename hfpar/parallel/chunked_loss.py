"""The LM head and its cross-entropy computed over token chunks: the [tokens, vocab] logits never exist at once.

    state = install_chunked_loss(model)            # on the output embedding (nn.Linear or hfpar's vocab-parallel head)
    with state.targets(shifted_labels):            # the next forward of the head returns the loss SUM, not logits
        loss_sum = model(**inputs).logits.reshape(())

For each chunk of C tokens the
head's logits (C, V/tp) are formed in the compute dtype, upcast to fp32, reduced to the log-sum-exp (over the
tensor-parallel group when the head is vocab-parallel: one max and one sum all-reduce per chunk), and turned at
once into the gradients of the loss sum w.r.t. the head's input and weight (softmax - one-hot), so backward only
scales them: the same three matmuls as the unchunked head, no recomputation. Peak extra memory: one chunk's fp32
logits plus the weight's gradient (which backward allocates anyway), instead of the full logits, their fp32
copy, their softmax and its gradient.

Inside `state.token_values(target)` the head returns per input row the target's log-prob and the entropy instead
(hfpar.parallel.chunked_logps: what GRPO's objective takes; its gradient per token is known only in backward, so
that one forms each chunk's logits again there).

The patched forward stays the original one whenever no targets are set (generation, users' own calls). Exact by
construction only where the model returns lm_head(hidden) as its logits. Which models do is decided by what their code
does, not by their names (logits_problem): a tiny float64 copy of the model's config (hfpar.parallel.tiny_copy) runs
one forward, and its logits must be exactly what its output embedding returned; models that scale (Cohere, Granite)
or soft-cap (Gemma 2) their logits after the head keep the full logits.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hfpar.parallel.chunked_logps import (  # noqa: F401  (LOGITS_PER_CHUNK: hfpar.planner reads it here)
    LOGITS_PER_CHUNK,
    chunked_apply,
    chunked_token_logps,
    vocab_shard,
)
from hfpar.parallel.comm import (
    all_reduce,
    copy_to_parallel_region,
    gather_from_sequence_parallel_region,
)
from hfpar.parallel.labels import IGNORE
from hfpar.parallel.language_model import text_config
from hfpar.parallel.tensor_parallel import ColumnParallelLinear
from hfpar.parallel.tiny_copy import check_once

_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head module -> ChunkedLoss


class _ChunkedLinearCE(torch.autograd.Function):
    """Sum over valid targets of -log softmax(h W^T + b)[target]; h (N, H), weight (V_l, H), target (N,)."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, group, chunk, cdt):
        tp, start, acc = vocab_shard(weight, group, cdt)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
            total = torch.zeros((), dtype=acc, device=h.device)
            for s in range(0, h.shape[0], chunk):
                hc, t = h[s : s + chunk].to(cdt), target[s : s + chunk]
                z = F.linear(hc, w, b).to(acc)  # (C, V_l) this chunk's logits
                m = z.detach().max(dim=-1).values
                if tp > 1:
                    m = all_reduce(m, group, op=dist.ReduceOp.MAX)
                z.sub_(m.unsqueeze(-1))
                valid = t != IGNORE
                mine = valid & (t >= start) & (t < start + z.shape[1])  # the target's row is local
                lt = (t - start).masked_fill(~mine, 0)
                z_t = z.gather(1, lt.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
                z.exp_()
                stats = torch.stack([z.sum(-1), z_t])
                if tp > 1:
                    stats = all_reduce(stats, group)
                sum_exp, z_t = stats.unbind(0)
                total += ((sum_exp.log() - z_t) * valid).sum()
                if grad_h is None and grad_w is None and grad_b is None:
                    continue
                z.div_(sum_exp.unsqueeze(-1))  # softmax shard
                z[torch.arange(z.shape[0], device=z.device), lt] -= mine.to(acc)  # - one-hot
                z.mul_(valid.to(acc).unsqueeze(-1))  # d loss_sum / d logits
                dz = z.to(cdt)
                if grad_h is not None:
                    grad_h[s : s + chunk] = (dz @ w).to(h.dtype)
                if grad_w is not None:
                    if dz.dtype == acc:
                        grad_w.addmm_(dz.t(), hc)
                    else:  # (V_l, H) product in cdt, then an acc copy: in row blocks no larger than the chunk's
                        rows = max(1, dz.numel() // hc.shape[1])  # logits, or the two would be V_l x H x 6 bytes
                        for r in range(0, grad_w.shape[0], rows):
                            grad_w[r : r + rows] += (dz[:, r : r + rows].t() @ hc).to(acc)
                if grad_b is not None:
                    grad_b += z.sum(0)
        ctx.grads = [grad_h, grad_w, grad_b]
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("chunked LM loss: backward uses its precomputed gradients once (no retain_graph)")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        out_h = grad_h.mul_(g.to(grad_h.dtype)) if grad_h is not None else None
        out_w = grad_w.mul_(g.to(grad_w.dtype)).to(ctx.dtypes[0]) if grad_w is not None else None
        out_b = grad_b.mul_(g.to(grad_b.dtype)).to(ctx.dtypes[1]) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None


def chunked_linear_cross_entropy(h, weight, bias, target, *, group=None, chunk: int | None = None) -> torch.Tensor:
    """Sum of the cross-entropy of F.linear(h, weight, bias) against target (IGNORE = -100 skipped), chunked over
    tokens. h (..., H) and target (...) flattened alike; weight the local vocab rows of a vocab-parallel head when
    group is its tensor-parallel group. Under autocast the matmuls run in the autocast dtype, the softmax in fp32."""
    return chunked_apply(_ChunkedLinearCE, h, weight, bias, target, group, chunk)


class ChunkedLoss:
    """The chunked-loss mode of one LM head (see the module docstring)."""

    def __init__(self, head: nn.Module, chunk: int | None):
        self.head, self.chunk, self._target, self._values = head, chunk, None, None
        self._temperature = 1.0  # of the token values' distribution (token_values)
        self.values_made = 0  # forwards that returned token values (token_values): whether a forward went here
        self._forward = head.forward
        tp = isinstance(head, ColumnParallelLinear) and head.tp > 1
        self.group = head.group if tp else None

    @contextlib.contextmanager
    def targets(self, target: torch.Tensor):
        """The head's forwards inside the block return the loss sum over `target` ((B, T), aligned with the head's
        input rows: causal-LM labels already shifted) as a (1, 1, 1) tensor in place of the logits."""
        self._target = target
        try:
            yield self
        finally:
            self._target = None

    @contextlib.contextmanager
    def token_values(self, target: torch.Tensor, temperature: float = 1.0):
        """The head's forwards inside the block return (..., 2) per input row: the log-prob of its `target` token
        (target's elements in the order of the head's input rows; differentiable) and the entropy of its next-token
        distribution (no gradient), of softmax(logits / temperature), chunked (hfpar.parallel.chunked_logps): what an
        RL objective takes."""
        self._values, self._temperature = target, temperature
        try:
            yield self
        finally:
            self._values, self._temperature = None, 1.0

    def _head_input(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head
        if isinstance(h, ColumnParallelLinear) and not h.in_region:  # as ColumnParallelLinear.forward
            if h.sequence_parallel:
                return gather_from_sequence_parallel_region(x, h.sequence_dim, h.group)
            return copy_to_parallel_region(x, h.group)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._values is not None:
            x = self._head_input(x)
            if x.shape[:-1].numel() != self._values.numel():
                raise ValueError(
                    f"chunked log-probs: the head's input {tuple(x.shape)} does not match the targets "
                    f"{tuple(self._values.shape)}"
                )
            lp, ent = chunked_token_logps(
                x,
                self.head.weight,
                self.head.bias,
                self._values,
                group=self.group,
                chunk=self.chunk,
                temperature=self._temperature,
            )
            self.values_made += 1
            return torch.stack([lp, ent], -1).view(*x.shape[:-1], 2)
        if self._target is None:
            return self._forward(x)
        x = self._head_input(x)
        if x.shape[:-1] != self._target.shape:
            raise ValueError(
                f"chunked LM loss: the head's input {tuple(x.shape)} does not match the targets "
                f"{tuple(self._target.shape)}; pass --loss_chunk_size 0"
            )
        loss = chunked_linear_cross_entropy(
            x, self.head.weight, self.head.bias, self._target, group=self.group, chunk=self.chunk
        )
        return loss.reshape(1, 1, 1)


def logits_problem(config) -> str | None:
    """Why `config`'s causal LM does not return its output embedding's output as its logits (so the chunked loss
    would not compute its loss), or None: checked on a tiny float64 copy, once per config."""
    if hasattr(config, "to_json_string") and text_config(config) is not config:
        return "a multimodal wrapper (its image / audio rows: the chunked loss is checked on text models only)"
    return check_once("logits", config, _logits_check)


def _logits_check(model) -> str | None:
    head = model.get_output_embeddings()
    if head is None:
        return "it has no output embedding (LM head)"
    seen = []
    hook = head.register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        with torch.no_grad():
            ids = torch.arange(1, 9).remainder(model.get_input_embeddings().weight.shape[0] - 1)[None] + 1
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    if len(seen) != 1 or not torch.equal(seen[0], logits):
        diff = float((seen[0] - logits).abs().max()) if seen and seen[0].shape == logits.shape else float("nan")
        return f"its logits are not its LM head's output (scaled or soft-capped after it: {diff:.1e} apart)"
    return None


def chunkable(model: nn.Module) -> str | None:
    """Why the model's LM head cannot take the chunked loss, or None."""
    config = getattr(model, "config", None)
    if why := logits_problem(config):
        return f"model_type {getattr(config, 'model_type', None)!r}: {why}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is nn.Linear:
        return None
    if isinstance(head, ColumnParallelLinear) and not head.gather_output and head.packed_splits is None:
        return None
    return f"its LM head is a {type(head).__name__} (chunked: nn.Linear or hfpar's vocab-parallel head)"


def install_chunked_loss(model: nn.Module, chunk: int | None = None) -> ChunkedLoss:
    """Patch the model's output embedding in place (before any data-parallel wrap); raises ValueError with the
    reason where it cannot (chunkable)."""
    why = chunkable(model)
    if why is not None:
        raise ValueError(f"chunked LM loss: {why}")
    head = model.get_output_embeddings()
    state = ChunkedLoss(head, chunk)
    head.forward = state.forward
    _STATES[head] = state
    return state


def chunked_loss_state(model: nn.Module) -> ChunkedLoss | None:
    """The ChunkedLoss installed on the model's head (through PEFT / DDP wrappers), or None."""
    for m in (model, getattr(model, "module", None)):
        head = m.get_output_embeddings() if m is not None and hasattr(m, "get_output_embeddings") else None
        if head is not None and head in _STATES:
            return _STATES[head]
    return None
