"""Does a model mix tokens anywhere but in its attention, and where? Context parallelism cuts every row over the cp
ranks and replaces the attention function (transformers' registry) with one that sees the whole row; a layer that
carries state along the sequence by other means (Mamba, gated-DeltaNet / linear attention, a causal convolution,
token shift) would run on this rank's part alone and compute something else: such a module runs on the whole rows
instead (gathered.py). Decided by what the model does, not by its name:

    classes, why = token_mixers(config)   # the mixer classes to gather; why not, where one cannot be gathered
    why = token_mixing_problem(config)    # that `why` alone (the preflight's refusal), or None

The run's tiny float64 copy (hfpar.parallel.tiny_copy: its config, widths shrunk, every kind of layer kept) runs with
an attention that lets each token see only itself; one token in the middle of a row is changed, and every module's
output at the OTHER positions must stay the same (1e-10 relative). The first module (in the order they finish) whose
output moves was mixed by the module of its decoder layer that holds it (`model.layers.0.mamba`): that module's class
is a mixer; its modules' outputs are then held at zero (token by token: nothing mixed) and the check runs again, until
nothing moves. A mixer that itself calls the attention function (an attention with a convolution of its own) cannot be
run on the whole row (its attention would then be CP's, given whole rows): refused, named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..language_model import text_config
from ..tiny_copy import check_once
from .gathered import class_name

SELF_ONLY = "hfpar_self_only"  # the attention the check registers: each token attends to itself alone
T = 12  # the check's row: a changed token in its middle, positions on both sides compared
TOL = 1e-10
KINDS = 8  # mixer classes looked for at most (a hybrid has one or two)
_CALLED: list = []  # modules that called the check's attention in the current forward


@dataclass(frozen=True)
class Mixers:
    """What the check found: the mixer classes (gathered.class_name) and one module of each (for messages)."""

    classes: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()


def _self_only(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """(B, H, T, D) query, (B, Hkv, T, Dv) value -> (B, T, H, Dv): each token's own value, no other token's."""
    _CALLED.append(module)
    rep = query.shape[1] // value.shape[1]
    out = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    return out.transpose(1, 2).contiguous(), None


def token_mixers(config) -> tuple[tuple[str, ...], str | None]:
    """(the classes of `config`'s model that mix tokens outside the attention and run on whole rows under CP, why CP
    cannot split it: a mixer that cannot be gathered, or the check could not run; None)."""
    # transformers imported on use: why: docs/architecture.md#why-start-up-time
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(SELF_ONLY, _self_only)
    # a multimodal wrapper: its language model (the sharded sequence; the towers keep their own attention)
    found = check_once("cp_token_mixing", text_config(config), _mixing, attn=SELF_ONLY)
    if isinstance(found, Mixers):
        return found.classes, None
    if found is None or "mixes tokens" in found:
        return (), found
    return (), f"whether it mixes tokens outside its attention could not be checked: {found}"


def token_mixing_problem(config) -> str | None:
    """Why context parallelism cannot split `config`'s model (a module mixes tokens outside the attention and cannot
    run on the whole rows, or the check could not run), or None."""
    return token_mixers(config)[1]


def _outputs(model: nn.Module, ids: torch.Tensor) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """Every module's (B, T, ...) output of one forward, in the order the modules finish."""
    seen: list = []
    names = {id(m): n for n, m in model.named_modules()}

    def hook(mod, args, out):
        t = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(ids.shape):
            seen.append((names.get(id(mod), type(mod).__name__), mod, t.detach().clone()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # (B, T, V)
    finally:
        for h in handles:
            h.remove()
    return [*seen, ("the model's logits", model, logits)]


def call_keys(outputs: list) -> list[tuple[str, int]]:
    """(module name, how many times it had been called before) of each recorded output."""
    seen: dict[str, int] = {}
    keys = []
    for name, _, _ in outputs:
        keys.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return keys


def in_layer(model: nn.Module, name: str, mod: nn.Module) -> tuple[str, nn.Module]:
    """The module of its decoder layer that holds `name` (`model.layers.0.mamba` for `model.layers.0.mamba.x_proj`,
    the first module a Mamba mixer's convolution reaches): what a user recognises."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if i is None or len(parts) <= i + 2:
        return name, mod
    held = ".".join(parts[: i + 2])
    return held, model.get_submodule(held)


def _moved(a: list, b: list, others: list[int], skip) -> tuple[str, nn.Module] | None:
    """The first module (name, module) whose output at `others` differs between the two forwards; `skip(name)`:
    not compared (a mixer found before, and what it holds)."""
    # matched by module and call (a module called a data-dependent number of times stays aligned)
    by_call = {key: y for key, (_, _, y) in zip(call_keys(b), b, strict=True)}
    for key, (name, mod, x) in zip(call_keys(a), a, strict=True):
        if skip(name) or key not in by_call or by_call[key].shape != x.shape:
            continue
        x, y = x[:, others], by_call[key][:, others]
        if ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item() > TOL:
            return name, mod
    return None


def _held_at_zero(mod, args, out):
    """Forward hook: a found mixer's per-token outputs replaced by zeros (nothing mixed: the check goes on)."""

    def zero(x):
        return torch.zeros_like(x) if isinstance(x, torch.Tensor) and x.dim() >= 2 else x

    if isinstance(out, tuple):
        return tuple(zero(x) for x in out)
    return zero(out)


def _mixing(model: nn.Module) -> Mixers | str:
    vocab = min(model.get_input_embeddings().num_embeddings, 100)
    ids = torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(0))  # (1, T)
    changed = ids.clone()
    changed[0, T // 2] = 3 + (ids[0, T // 2] - 2) % (vocab - 3)  # another token at the middle position only
    others = [t for t in range(T) if t != T // 2]
    classes: list[str] = []
    examples: list[str] = []
    prefixes: list[str] = []
    handles: list = []
    try:
        for _ in range(KINDS):
            _CALLED.clear()
            a = _outputs(model, ids)
            called = {id(m) for m in _CALLED}
            b = _outputs(model, changed)
            hit = _moved(a, b, others, lambda n: any(n == p or n.startswith(p + ".") for p in prefixes))
            if hit is None:
                return Mixers(tuple(classes), tuple(examples))
            name, mod = in_layer(model, *hit)
            if mod is model or any(id(m) in called for m in mod.modules()):
                return (
                    f"{name} ({type(mod).__name__}) mixes tokens outside the attention (its output at one position "
                    "moves with another position's token: state carried along the sequence, a convolution or a "
                    "linear attention) and calls the attention itself, so context parallelism, cutting the row over "
                    "the cp ranks, can neither compute it on this rank's part alone nor run it on the whole row"
                )
            classes.append(class_name(type(mod)))
            examples.append(f"{name} ({type(mod).__name__})")
            for n, m in model.named_modules():
                if class_name(type(m)) == classes[-1]:
                    prefixes.append(n)
                    handles.append(m.register_forward_hook(_held_at_zero))
        return f"each of more than {KINDS} kinds of module mixes tokens outside the attention ({', '.join(examples)})"
    finally:
        _CALLED.clear()  # no module of the tiny copy held after the check
        for h in handles:
            h.remove()
