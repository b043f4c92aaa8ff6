"""Forward hooks apply_tensor_parallel installs on an HF model's modules (apply.py decides where).

scatter_sequence_hook   the first decoder block (SP): its hidden_states split along T, (B, T, H) -> (B, T/tp, H)
gather_sequence_hook    the final norm (SP, sequence_gather): T all-gathered, backward keeps this rank's chunk
enter_region_hook       an attention / MLP region: copy into the TP region (bwd all-reduce), or under SP the
                        all-gather of T (bwd reduce-scatter)
local_head_bias_hook    an attention taking a per-head bias built for all heads (Bloom's alibi, MPT's
                        position_bias): this rank's heads of it
embed_scale_hook        Gemma's scaled embedding on a VocabParallelEmbedding
"""

from __future__ import annotations

from functools import partial

import torch

from ..comm import (
    copy_to_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "HEAD_BIAS_ARGS",
    "embed_scale_hook",
    "enter_region_hook",
    "gather_sequence_hook",
    "local_head_bias_hook",
    "scatter_sequence_hook",
]


def _map_hidden(args: tuple, kwargs: dict, fn, where: str):
    """Apply fn to a module's hidden_states argument (first positional or keyword `hidden_states`); the same tensor
    passed again positionally (CTRL's attention(v, k, q) called with one `normed` three times) gets the same result,
    so every projection of it is inside the region."""
    if args:
        x = fn(args[0])
        return (x, *(x if a is args[0] else a for a in args[1:])), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise TypeError(f"{where}: tensor-parallel hook found no hidden_states argument")


def scatter_sequence_hook(module, args, kwargs, *, group, tp: int, name: str):
    def split(x):  # (B, T, H) -> (B, T/tp, H)
        if x.shape[1] % tp:
            raise ValueError(
                f"{name}: sequence_parallel needs the sequence length divisible by tp_size {tp}, got "
                f"T={x.shape[1]} (input {tuple(x.shape)}); pad batches to a multiple of {tp}"
            )
        return scatter_to_sequence_parallel_region(x, 1, group)

    return _map_hidden(args, kwargs, split, name)


def gather_sequence_hook(module, args, kwargs, *, group, name: str):
    # (B, T/tp, H) -> (B, T, H); what follows (norm, LM head with its own backward all-reduce) runs on every
    # rank with full gradients, so the backward keeps this rank's chunk (no reduce-scatter)
    return _map_hidden(
        args, kwargs, partial(gather_from_sequence_parallel_region, dim=1, group=group, reduce_grad=False), name
    )


def enter_region_hook(module, args, kwargs, *, group, sequence_parallel: bool, name: str):
    if sequence_parallel:  # (B, T/tp, H) -> (B, T, H); bwd: reduce-scatter the partial (local heads) grads
        fn = partial(gather_from_sequence_parallel_region, dim=1, group=group)
    else:  # (B, T, H) identity; bwd: all-reduce the partial grads once for q, k and v
        fn = partial(copy_to_parallel_region, group=group)
    return _map_hidden(args, kwargs, fn, name)


HEAD_BIAS_ARGS = ("alibi", "position_bias")  # per-head attention biases a model builds once for all heads


def local_head_bias_hook(module, args, kwargs, *, names, tp: int, heads: int, group, positions=None):
    """This rank's heads of a per-head bias argument: Bloom's alibi (B * H, 1, T), MPT's position_bias (H, 1, T),
    CPM-Ant's (B, H, T, T) passed positionally (positions: {name: index in forward's parameters}). The layout is read
    from the shape; one this does not recognise is passed as is (the plan's verification then refuses the family).
    The slice's backward all-gathers the heads' gradients: a bias the model learns (CPM-Ant's relative position bias,
    built once outside the blocks) gets its whole gradient on every rank, as one process computes it."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    b = hidden.shape[0] if isinstance(hidden, torch.Tensor) else None
    n = heads // tp
    own = partial(scatter_to_sequence_parallel_region, group=group)  # this rank's chunk of a dim; bwd all-gather
    for name in names:
        pos = (positions or {}).get(name)
        at = pos if name not in kwargs and pos is not None and pos < len(args) else None
        t = kwargs.get(name) if at is None else args[at]
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        if t.shape[1] == heads and (t.dim() >= 4 or (b is not None and t.shape[0] in (b, 1))):
            t = own(t, dim=1)  # (B, H, ...) -> (B, H/tp, ...): first, a batch as large as the heads is no head dim
        elif b is not None and t.shape[0] == b * heads:  # (B * H, ...) -> (B * H/tp, ...)
            t = own(t.view(b, heads, *t.shape[1:]), dim=1).reshape(b * n, *t.shape[1:])
        elif t.shape[0] == heads:  # (H, ...) -> (H/tp, ...)
            t = own(t, dim=0)
        if at is None:
            kwargs = {**kwargs, name: t}
        else:
            args = (*args[:at], t, *args[at + 1 :])
    return args, kwargs


def embed_scale_hook(module, args, out):
    return out * module.embed_scale.to(module.weight.dtype)  # (B, T, H)
