"""Does a model mix tokens anywhere but in its attention? Context parallelism cuts every row over the cp ranks and
replaces only the attention function (transformers' registry) with one that sees the whole row; a layer that
carries state along the sequence by other means (Mamba, gated-DeltaNet / linear attention, a causal convolution,
token shift) would run on this rank's part alone and silently compute something else. Decided by what the model
does, not by its name:

    why = token_mixing_problem(config)     # None, or one line naming the first module that mixes tokens

The run's tiny float64 copy (hfpar.parallel.tiny_copy: its config, widths shrunk, every kind of layer kept) runs with
an attention that lets each token see only itself; one token in the middle of a row is changed, and every module's
output at the OTHER positions must stay the same (1e-10 relative). The first module (in the order they finish) whose
output moves is named: the attention then mixes nothing, so whatever moves was mixed by that module.
"""

from __future__ import annotations

import torch
from torch import nn

from ..language_model import text_config
from ..tiny_copy import check_once

SELF_ONLY = "hfpar_self_only"  # the attention the check registers: each token attends to itself alone
T = 12  # the check's row: a changed token in its middle, positions on both sides compared
TOL = 1e-10


def _self_only(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """(B, H, T, D) query, (B, Hkv, T, Dv) value -> (B, T, H, Dv): each token's own value, no other token's."""
    rep = query.shape[1] // value.shape[1]
    out = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    return out.transpose(1, 2).contiguous(), None


def token_mixing_problem(config) -> str | None:
    """Why context parallelism cannot split `config`'s model (a module mixes tokens outside the attention, or the
    check could not run), or None."""
    # transformers imported on use: why: docs/architecture.md#why-start-up-time
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(SELF_ONLY, _self_only)
    # a multimodal wrapper: its language model (the sharded sequence; the towers keep their own attention)
    why = check_once("cp_token_mixing", text_config(config), _mixing, attn=SELF_ONLY)
    if why is None or "mixes tokens" in why:
        return why
    return f"whether it mixes tokens outside its attention could not be checked: {why}"


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


def _mixing(model: nn.Module) -> str | None:
    vocab = min(model.get_input_embeddings().num_embeddings, 100)
    ids = torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(0))  # (1, T)
    changed = ids.clone()
    changed[0, T // 2] = 3 + (ids[0, T // 2] - 2) % (vocab - 3)  # another token at the middle position only
    others = [t for t in range(T) if t != T // 2]
    a, b = _outputs(model, ids), _outputs(model, changed)
    # matched by module and call (a module called a data-dependent number of times stays aligned)
    by_call = {key: y for key, (_, _, y) in zip(call_keys(b), b, strict=True)}
    for key, (name, mod, x) in zip(call_keys(a), a, strict=True):
        if key not in by_call or by_call[key].shape != x.shape:
            continue
        x, y = x[:, others], by_call[key][:, others]
        if ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item() > TOL:
            name, mod = in_layer(model, name, mod)
            return (
                f"{name} ({type(mod).__name__}) mixes tokens outside the attention (its output at one position moves "
                "with another position's token: state carried along the sequence, a convolution or a linear "
                "attention), which context parallelism, cutting the row over the cp ranks, would compute on this "
                "rank's part alone"
            )
    return None
