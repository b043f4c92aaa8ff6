"""The experts' grouped matmul on CPU, with a hand-written backward: y_g = x_g @ w[g].T over contiguous row groups.

    y = grouped_linear(x_sorted, w, counts)       # x (M, in) sorted by group, w (G, out, in), counts: G python ints
    if grouped_linear_applies(x, w): ...          # CPU, same dtype, no autocast (else the callers' own path)

The backward writes the weight gradient into a buffer the experts module keeps (`cache`, a dict the module owns)
and reuses it a step later when nothing else holds it any more (its storage's reference count; while anything holds
it, e.g. .grad under gradient accumulation, it takes fresh memory): the experts' gradient memory stays allocated
between steps, one buffer per weight. It writes each hit expert's gradient once in place (torch.mm(out=)), zeroes
unhit experts' slices and skips the weight gradient of frozen experts. Forward and input gradient are the same
per-group GEMMs as F.grouped_mm's: results agree to round-off (tests/distributed/test_moe_layers.py).
why: docs/architecture.md#why-the-parallel-layers
"""

from __future__ import annotations

import torch

__all__ = ["grouped_linear", "grouped_linear_applies", "weight_grad_buffer"]


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_REUSE = hasattr(torch._C, "_storage_Use_Count")
_ALONE = _storage_refs(torch.empty(1)) if _REUSE else 0  # the count of a tensor no one else holds


def weight_grad_buffer(shape, like: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """An uninitialised tensor (shape, like's dtype / device): one of `cache`'s that nothing else holds any more,
    else a new one, kept in `cache` if it keeps none yet (one per shape). cache=None: always new."""
    if cache is None or not _REUSE:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    key = (tuple(shape), like.dtype, like.device)
    kept = cache.setdefault(key, [])
    for t in kept:
        if _storage_refs(t) <= _ALONE:
            return t.detach()  # a new tensor on the same storage: autograd hands it to .grad as is
    t = torch.empty(shape, dtype=like.dtype, device=like.device)
    if not kept:
        kept.append(t)
    return t.detach()


def grouped_linear_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_linear serves (x, w): CPU tensors of one floating dtype, outside autocast (which would
    change F.linear's dtype: the callers' per-group F.linear keeps that behaviour)."""
    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dtype == w.dtype
        and x.is_floating_point()
        and not torch.is_autocast_enabled("cpu")
    )


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: list[int], cache: dict | None) -> torch.Tensor:
        x = x.contiguous()
        if torch.compiler.is_compiling():
            # traced (--torch_compile): no writes into views of a fresh tensor. Under no_grad (evaluation) dynamo
            # inlines this forward, DDP's graph splitter can cut between the buffer and its writes, and AOT
            # autograd then fails on the mutated aliased inputs (torch 2.13, dynamic shapes). Same GEMMs.
            out = torch.cat([xg @ w[g].t() for g, xg in enumerate(x.split(counts))])
        else:
            out = x.new_empty(x.shape[0], w.shape[1])  # (M, out)
            for g, (xg, og) in enumerate(zip(x.split(counts), out.split(counts))):
                if xg.shape[0]:
                    torch.mm(xg, w[g].t(), out=og)
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.cache = counts, cache
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w = ctx.saved_tensors
        counts = ctx.counts
        grad_out = grad_out.contiguous()
        gos = grad_out.split(counts)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)  # (M, in)
            for g, (go, gx) in enumerate(zip(gos, grad_x.split(counts))):
                if go.shape[0]:
                    torch.mm(go, w[g], out=gx)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad_buffer(w.shape, w, ctx.cache)  # (G, out, in), w's layout
            for g, (go, xg) in enumerate(zip(gos, x.split(counts))):
                if go.shape[0]:
                    torch.mm(go.t(), xg, out=grad_w[g])
                else:
                    grad_w[g].zero_()  # an unhit expert: zero, as autograd's
        return grad_x, grad_w, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int], cache: dict | None = None) -> torch.Tensor:
    """Rows of x (M, in) grouped by group in order (counts[g] rows for group g, zeros allowed) -> x_g @ w[g].T,
    (M, out); w (G, out, in). Differentiable in x and w (weight gradient: every group's slice, zero if unhit), the
    weight gradient in a buffer of `cache` (weight_grad_buffer; None: fresh memory each backward)."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"grouped_linear: {len(counts)} groups of {sum(counts)} rows for {w.shape[0]} weights and {x.shape[0]} rows"
        )
    return _GroupedLinear.apply(x, w, counts, cache)
