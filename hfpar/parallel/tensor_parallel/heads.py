"""Per-rank head counts on one attention module, never on the shared config (which keeps the full counts for export).

localize_heads(attn, model.config, tp)     # attn.num_heads //= tp, ...; attn.config sees per-rank head counts
"""

from __future__ import annotations

from torch import nn

__all__ = ["HEAD_COUNTS", "config_heads", "head_count_values", "layer_config", "localize_heads"]

# the attributes attention modules hold their (query) head count in
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_WIDTHS = ("hidden_size", "embed_dim", "all_head_size")


class _LocalHeadsConfig:
    """The model config as one attention module sees it: per-rank head counts, every other field
    read live from the shared config (which keeps the full counts for export / save_pretrained)."""

    def __init__(self, base, **overrides):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_base", "_overrides"):
            raise AttributeError(name)
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._base, name)

    def __setattr__(self, name, value):
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._base, name, value)

    def __repr__(self) -> str:
        return f"_LocalHeadsConfig({self._overrides}, base={type(self._base).__name__})"


def localize_heads(attn: nn.Module, config, tp: int, widths: bool = False) -> None:
    """Per-rank head counts on the attention module (never on the shared config); GPT-2's split_size (the
    width of each of q, k, v in c_attn's output) with them; widths: an attribute that is all the heads' width (heads x
    head_dim: DBRX splits its fused qkv by `hidden_size`, XGLM reshapes its output by `embed_dim`) too (the plan's
    `attention_widths` regions: CodeGen's forward needs its embed_dim whole, so only a verified plan says which)."""
    heads = next((v for a in HEAD_COUNTS if isinstance(v := getattr(attn, a, None), int)), None)
    head_dim = getattr(attn, "head_dim", None) or getattr(attn, "attention_head_size", None)  # BERT's name
    for attr in _WIDTHS if widths else ():
        v = getattr(attn, attr, None)
        if isinstance(v, int) and isinstance(heads, int) and isinstance(head_dim, int) and v == heads * head_dim:
            setattr(attn, attr, v // tp)
    for attr in (
        "num_heads",
        "num_attention_heads",
        "num_key_value_heads",
        "num_kv_heads",
        "split_size",
        "n_heads",
        "n_head",
    ):
        v = getattr(attn, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(attn, attr, v // tp)
    if getattr(attn, "config", None) is not None and config is not None:  # e.g. Phi-3 reads config.num_attention_heads
        nh, nkv = config_heads(config, attn)
        attn.config = _LocalHeadsConfig(config, num_attention_heads=nh // tp, num_key_value_heads=nkv // tp)


def layer_config(config, module: nn.Module):
    """The config that sizes `module`'s layer: config.per_layer_config[module.layer_idx] where the config is given per
    layer (Dots3-note: 64 heads in some layers, 128 in others; its global head count raises as ambiguous), else the
    config itself."""
    per_layer, idx = _per_layer(config), getattr(module, "layer_idx", None)
    return per_layer[idx] if isinstance(idx, int) and 0 <= idx < len(per_layer) else config


def _per_layer(config) -> list:
    """The config's per-layer configs (transformers' heterogeneous configs: a sequence view), else []."""
    view = getattr(config, "per_layer_config", None)
    try:
        return list(view) if view is not None and not isinstance(view, (str, dict)) else []
    except (TypeError, AttributeError):  # not a sequence (BLT's view has no layer count)
        return []


def config_heads(config, attn: nn.Module) -> tuple[int, int]:
    """(query heads, key-value heads) of the attention module `attn` as its config gives them (per layer, where
    the config is: layer_config)."""
    cfg = layer_config(config, attn)
    nh = getattr(cfg, "num_attention_heads", None)
    if not isinstance(nh, int):  # a config without the field (BLT's): the module's own count
        nh = next((v for a in HEAD_COUNTS if isinstance(v := getattr(attn, a, None), int)), 1)
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(attn, "num_key_value_heads", None)
    return nh, kv if isinstance(kv, int) else nh


def head_count_values(config, kv: bool = True) -> set[int]:
    """Every query (and, with kv, key-value) head count the config gives, over its layers where it is given per layer
    (a global read of a per-layer field raises in transformers' heterogeneous configs)."""
    layers = _per_layer(config)
    out: set[int] = set()
    for cfg in layers or [config]:
        h = getattr(cfg, "num_attention_heads", None)
        both = (h, getattr(cfg, "num_key_value_heads", None) or h) if kv else (h,)
        out.update(n for n in both if isinstance(n, int) and n > 1)
    return out
