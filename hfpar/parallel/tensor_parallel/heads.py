"""Per-rank head counts on one attention module, never on the shared config (which keeps the full counts for export).

localize_heads(attn, model.config, tp)     # attn.num_heads //= tp, ...; attn.config sees per-rank head counts
"""

from __future__ import annotations

from torch import nn

__all__ = ["HEAD_COUNTS", "localize_heads"]

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
    head_dim = getattr(attn, "head_dim", None)
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
        nh = config.num_attention_heads
        nkv = getattr(config, "num_key_value_heads", None) or nh
        attn.config = _LocalHeadsConfig(config, num_attention_heads=nh // tp, num_key_value_heads=nkv // tp)
