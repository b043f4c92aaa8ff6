"""Token mixers other than attention under context parallelism: run on the whole row, on every cp rank.

    gather_mixers(model, classes)   # once, in place: every module of those classes (mixing.token_mixers)

A Mamba / Mamba-2 mixer, a gated-DeltaNet or other linear attention, a short causal convolution carries state along
the sequence (mixing.py finds them by what they do). Cut over the cp ranks, each would see its own part of the row
and compute something else. Inside cp_rows, a gathered module's per-token inputs (its hidden states, a (B, T) mask or
position ids / sequence index) are all-gathered over the cp group and put back in position order, the module runs on
the whole rows exactly as one process runs it (its own kernels, its packing / padding handling), and each rank keeps
its own positions of every per-token output. Backward: the gradient of the gathered input is reduce-scattered (each
rank's share of every position summed), so the parameters' and the hidden states' gradients are one process's.
Outside cp_rows (generation, a whole-sequence forward) the module runs as transformers wrote it.

Why by hand: no library shards these mixers along the sequence for a transformers model (Megatron's Mamba context
parallelism re-shards heads inside its own Mamba layer). The cost, said where CP is enabled: these layers' compute
and activations are a whole row's on every rank (they are linear in the row's length); attention, the MLPs and the
residual stream stay sharded.
"""

from __future__ import annotations

import functools
import inspect
import threading
import zlib

import torch
from torch import nn

from ..comm import all_gather, gather_from_sequence_parallel_region
from .state import _state

GATHERED = "_hfpar_cp_gathered"  # set on a module whose forward hooks gather / cut its rows
_cuts = threading.local()  # id(module) -> what its forward hook cuts (per thread: shard_check's emulated ranks)


def class_name(cls: type) -> str:
    """How a mixer class is named between the check (tiny copy) and the model: module path and qualified name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def gather_mixers(model: nn.Module, classes) -> list[str]:
    """Hooks on every module of `model` whose class is named in `classes` (idempotent); the names of those modules."""
    wanted, names = set(classes), []
    for name, mod in model.named_modules():
        if class_name(type(mod)) not in wanted:
            continue
        names.append(name)
        if not getattr(mod, GATHERED, False):
            mod.register_forward_pre_hook(_gather_inputs, with_kwargs=True)
            mod.register_forward_hook(_cut_outputs)
            setattr(mod, GATHERED, True)
    return names


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """(B, Tl, ...) -> (B, cp * Tl, ...) in rank order (the cp group's all-gather; an emulated group's own)."""
    emulated = getattr(group, "gather_rows", None)  # shard_check.EmulatedGroup: cp ranks as threads
    if emulated is not None:
        return emulated(x)
    if x.is_floating_point():  # gradients flow back: reduce-scattered
        return gather_from_sequence_parallel_region(x, 1, group)
    if x.dtype == torch.bool:  # collectives of every backend take integers
        return all_gather(x.to(torch.uint8), 1, group).bool()
    return all_gather(x, 1, group)


def _position_order(rows) -> torch.Tensor:
    """(T,) index that puts a row gathered in rank order (RowLayout.order) back in position order; once per batch."""
    if "position_order" not in rows.cache:
        rows.cache["position_order"] = torch.argsort(rows.order)
    return rows.cache["position_order"]


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """A mixer class's forward signature without `self` (read once per class: the hook runs every call)."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return inspect.Signature(params)


def _whole_mask(local, rows) -> torch.Tensor | None:
    """The (B, T) padding mask of the whole rows, from the layout every rank shares (RowLayout.doc: -1 at padding),
    for a mixer's `attention_mask`. A model that passes None where its part holds no padding (Qwen3.5's linear
    attention mask) would pass None on one rank and a mask on another: each rank then passes what one process passes
    for the whole rows (None where they hold no padding and this rank's part came as None). Made once per batch
    (RowLayout.cache): every mixer layer of the forward asks."""
    if "real" not in rows.cache:
        real = rows.doc >= 0
        rows.cache["real"] = (real, bool(real.all()))
    real, unpadded = rows.cache["real"]
    if local is None and unpadded:
        return None
    return real.to(local.dtype if isinstance(local, torch.Tensor) else torch.long)


def _per_token(x, b: int, tl: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (b, tl)


def _agree(mod: nn.Module, gathered: list[str], group, device) -> None:
    """Every cp rank gathers the same arguments (else the all-gathers would pair wrongly or wait forever): the names
    of the arguments this rank gathers, as one checksum, compared over the group first (one small all-gather, and on
    a GPU a wait for it: a cost per mixer call, paid because a wrong pairing could otherwise train silently wrong);
    RuntimeError naming the module and this rank's arguments if they differ."""
    mine = torch.tensor([[zlib.crc32(",".join(gathered).encode())]], dtype=torch.long, device=device)  # (1, 1)
    every = _gather(mine, group).view(-1)  # (cp,)
    if not bool((every == every[0]).all()):
        raise RuntimeError(
            f"context parallelism: the cp ranks called {type(mod).__name__} with different per-token arguments "
            f"(this rank: {', '.join(gathered)}); it cannot run on the whole rows"
        )


def _gather_inputs(mod: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: every (B, Tl, ...) tensor argument gathered to (B, T, ...) in position order; an
    `attention_mask` passed becomes the whole rows' (_whole_mask)."""
    state = getattr(_state, "cur", None)
    cuts = _cuts.__dict__.setdefault("by_module", {})
    cuts.pop(id(mod), None)
    if state is None:
        return None
    rows, group, _ = state
    b, tl = rows.doc.shape[0], rows.local.numel()
    bound = _signature(type(mod)).bind_partial(*args, **kwargs)
    named = bound.arguments
    mask = "attention_mask" in named and (named["attention_mask"] is None or _per_token(named["attention_mask"], b, tl))
    if mask:
        named["attention_mask"] = _whole_mask(named["attention_mask"], rows)
    args, kwargs = bound.args, bound.kwargs
    gathered = [f"#{i}" for i, a in enumerate(args) if _per_token(a, b, tl)]
    _agree(mod, gathered + sorted(k for k, v in kwargs.items() if _per_token(v, b, tl)), group, rows.doc.device)
    inv = _position_order(rows)

    def whole(x):
        if _per_token(x, b, tl):
            return _gather(x, group).index_select(1, inv.to(x.device))
        return x

    cuts[id(mod)] = (rows.local, b, rows.doc.shape[1])
    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def _cut_outputs(mod: nn.Module, args, out):
    """Forward hook: this rank's positions of every (B, T, ...) output tensor."""
    cut = _cuts.__dict__.get("by_module", {}).pop(id(mod), None)
    if cut is None:
        return None
    local, b, t = cut

    def own(x):
        return x.index_select(1, local.to(x.device)) if _per_token(x, b, t) else x

    if isinstance(out, torch.Tensor):
        return own(out)
    if isinstance(out, tuple):
        return type(out)(own(x) for x in out) if not hasattr(out, "_fields") else type(out)(*map(own, out))
    if isinstance(out, list):
        return [own(x) for x in out]
    if isinstance(out, dict):  # a ModelOutput: its fields in place
        for k in list(out.keys()):
            out[k] = own(out[k])
    return out
