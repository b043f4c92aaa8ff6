"""A query scaling computed from the index in the sequence the module is given, under context parallelism.

    cp_temperature(model)                    # with enable_cp_attention: every such attention module, once
    query = temperature(module, query, rows)  # in cp_attention_forward: the scaling with whole-row indices

Llama 4's attention temperature tuning (arXiv 2501.19399) scales the queries of its layers without rotary embeddings
(NoPE) by log1p(floor((i + 1) / floor_scale)) * attn_scale + 1, where i is the token's index in the sequence the
attention module is given (torch.arange over its length, not the position ids). Under CP the module is given this
rank's zigzag part of the row, so i would be the local index: the family sweep measured a relative difference of 1.1
in that layer's output. Decided by what the module holds (attn_temperature_tuning with floor_scale and attn_scale, on a
layer without rotary: use_rope false), not by a family name: inside cp_rows the module reads its
`attn_temperature_tuning` as off (a property of the module's class, per thread: the emulated ranks of shard_check.py
are threads), and cp_attention_forward applies the same scaling with each token's index in the whole row
(RowLayout.local), in the same float32 arithmetic and cast, so the queries are bit for bit one process's. Outside
cp_rows (generation with whole rows and a KV cache: enable.whole_sequence) the module scales as transformers does.
"""

from __future__ import annotations

import torch
from torch import nn

from .state import current_layout

_CLASSES: dict[type, type] = {}
_FLAG = "attn_temperature_tuning"
_OWN = "_hfpar_attn_temperature_tuning"  # the module's own setting, kept while the class property answers


def _scales_queries(mod: nn.Module) -> bool:
    return (
        getattr(mod, _FLAG, None) is True
        and not getattr(mod, "use_rope", True)  # only its NoPE layers scale (Llama 4: use_rope 0 / 1)
        and all(isinstance(getattr(mod, a, None), (int, float)) for a in ("floor_scale", "attn_scale"))
    )


def _cp_class(cls: type) -> type:
    if cls not in _CLASSES:

        def get(self) -> bool:  # off inside cp_rows: cp_attention_forward scales with whole-row indices instead
            return bool(self.__dict__[_OWN]) and current_layout() is None

        def set_(self, value) -> None:
            self.__dict__[_OWN] = value

        _CLASSES[cls] = type(
            f"ContextParallel{cls.__name__}", (cls,), {_FLAG: property(get, set_), "__module__": cls.__module__}
        )
    return _CLASSES[cls]


def cp_temperature(model: nn.Module) -> list[str]:
    """Every attention module of `model` that scales its queries by their index in the sequence (module docstring)
    takes them from the whole rows under cp_rows (in place, idempotent); returns their names."""
    done = []
    for name, mod in model.named_modules():
        if type(mod) not in _CLASSES.values() and _scales_queries(mod):
            own = mod.__dict__.pop(_FLAG)
            mod.__class__ = _cp_class(type(mod))
            mod.__dict__[_OWN] = own
            done.append(name)
    return done


def temperature(module: nn.Module, query: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """query (B, H, Tl, D) of this rank's tokens, whose indices in the whole row are `local` (Tl,), scaled as the
    module's own code scales the whole row's (modeling_llama4: (q * scales).to(q.dtype), scales in float32); as it
    is for a module cp_temperature did not change or whose own setting is off."""
    if type(module) not in _CLASSES.values() or not module.__dict__.get(_OWN):
        return query
    positions = local.to(query.device)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)
