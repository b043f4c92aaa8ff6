"""The boundary between pipeline stages: what a stage hands on and what of the base model runs around its layers.

layers = decoder_layers(model)              # the base model's layer list, or ValueError in one line
post = post_layer_modules(model.config)     # ("norm",): its children run after the layers (on its tiny copy)
drop_post_layer(base, post)                 # on a stage that is not the last: they stand aside (_Handed)
cfg = stage_config(base.config, n, start, stop)   # depth fields and per-layer kinds for layers [start, stop)
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from hfpar.parallel.language_model import pipeline_refusal
from hfpar.parallel.tiny_copy import DEPTH_FIELDS, tiny_model

__all__ = ["decoder_layers", "drop_post_layer", "post_layer_children", "post_layer_modules", "stage_config"]


def _base(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return base if base is not None else getattr(model, "model", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a *ForCausalLM, or ValueError in one line naming the model."""
    if why := pipeline_refusal(getattr(model, "config", None), type(model).__name__):
        raise ValueError(f"pipeline parallelism: {why}")
    base = _base(model)
    layers = getattr(base, "layers", None)
    if (
        getattr(model.config, "is_encoder_decoder", False)
        or not isinstance(layers, nn.ModuleList)
        or not hasattr(model, "lm_head")
    ):
        raise ValueError(
            f"pipeline parallelism: {type(model).__name__} is not a decoder-only causal LM whose base "
            "model holds a `layers` ModuleList (Llama, Mistral, Qwen2/3, Gemma, Phi-3 style)"
        )
    return layers


_POST: dict[str, tuple[str, ...] | None] = {}


def post_layer_children(model: nn.Module) -> tuple[str, ...]:
    """Names of the base model's children whose first call comes after its last layer's (the final norm, whatever
    its name), found by running `model` (a small copy) once on 2 x 8 ids."""
    base, order = _base(model), []
    layers = base.layers
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: order.append(n)) for n, m in base.named_children()]
    handles.append(layers[-1].register_forward_pre_hook(lambda mod, args: order.append("<last layer>")))
    try:
        with torch.no_grad():
            model(input_ids=_ids(model), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if "<last layer>" not in order:
        return ()
    first = {n: i for i, n in reversed(list(enumerate(order)))}
    last_layer = max(i for i, n in enumerate(order) if n == "<last layer>")
    return tuple(n for n, i in first.items() if i > last_layer and n != "layers")


def post_layer_modules(config) -> tuple[str, ...] | None:
    """post_layer_children of `config`'s tiny copy (cached per config); None where no copy can be built or run."""
    key = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else None
    if key is None or getattr(config, "auto_map", None):
        return None
    if key not in _POST:
        try:
            model = tiny_model(copy.deepcopy(config))
            _POST[key] = None if isinstance(model, str) else post_layer_children(model)
        except Exception:  # noqa: BLE001 - whatever the family raises: unknown (the stage then drops nothing)
            _POST[key] = None
    return _POST[key]


class _Handed(nn.Module):
    """What stands for a module the base model runs after its layers on a stage that is not the last (its output is
    not what the stage hands on): returns its first input, whatever it is called with."""

    def forward(self, x, *args, **kwargs):
        return x


def drop_post_layer(base: nn.Module, post: tuple[str, ...] | None) -> None:
    """The base model's modules that run after its layers (post; None: unknown, then `norm`) replaced by _Handed."""
    for name in ("norm",) if post is None else post:
        if isinstance(getattr(base, name, None), nn.Module):
            setattr(base, name, _Handed())


def stage_config(config, n: int, start: int, stop: int):
    """A copy of the base model's config for layers [start, stop) of n: the depth fields the forward loops over
    (num_hidden_layers; LongCat-Flash loops over num_layers, half of its num_hidden_layers: each scaled), and the
    per-layer kinds it may index by position (layer_types; where the family derives it, left alone)."""
    cfg = copy.copy(config)
    for field in DEPTH_FIELDS:
        v = cfg.to_dict().get(field)
        if isinstance(v, int) and not isinstance(v, bool) and v % n == 0 and v:
            setattr(cfg, field, v // n * (stop - start))
    kinds = cfg.to_dict().get("layer_types")
    if isinstance(kinds, list) and len(kinds) == n:
        with contextlib.suppress(AttributeError):  # a property derived from other fields (Bamba, Jamba)
            cfg.layer_types = kinds[start:stop]
    return cfg


def _ids(model: nn.Module) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(3, min(vocab, 100), (2, 8), generator=torch.Generator().manual_seed(0))
