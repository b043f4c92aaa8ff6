"""Dynamic rotary embeddings under context parallelism: frequencies chosen from the whole row, not the rank's part.

    cp_rotary(model)      # with enable_cp_attention: every dynamic rotary module of the model, once

transformers' dynamic RoPE types pick their frequencies from the largest position id of the batch they are given
(modeling_rope_utils.dynamic_rope_update): `longrope` switches to its long factors once max(position_ids) + 1 passes
original_max_position_embeddings (Phi-3 / Phi-3.5 / Phi-4-mini), `dynamic` NTK rescales beyond
max_position_embeddings. Under CP a rank holds chunks of every row (zigzag), so it would see its own largest
position: at lengths just past the threshold, the ranks holding only early chunks would rotate with the short factors
while one process, and the other ranks, use the long ones (cp = 2, original 4096: rows of 4097 to ~5460 tokens).

The fix, decided by what the module is (a `rope_type` naming a dynamic kind), not by a family name: its forward is
called with one more position column, the largest position id of the same rows over the whole cp group (published
with the row layout by cp_rows: RowLayout.tops), and that column's outputs are dropped. Its frequencies are then
those of one process, and every real position's cos / sin is computed as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import current_tops

_CLASSES: dict[type, type] = {}


def _dynamic(mod: nn.Module) -> bool:
    kinds = getattr(mod, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def _cp_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, x, position_ids, *args, **kwargs):
            tops = current_tops()  # (B,) largest position per row of the whole rows, or None outside cp_rows
            if tops is None or position_ids.dim() != 2:
                return cls.forward(self, x, position_ids, *args, **kwargs)
            top = tops.max().to(position_ids).expand(position_ids.shape[0], 1)
            out = cls.forward(self, x, torch.cat([position_ids, top], dim=1), *args, **kwargs)
            return tuple(o[:, :-1] for o in out) if isinstance(out, (tuple, list)) else out[:, :-1]

        _CLASSES[cls] = type(
            f"ContextParallel{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__}
        )
    return _CLASSES[cls]


def cp_rotary(model: nn.Module) -> list[str]:
    """Every dynamic rotary module of `model` sees the whole rows' largest position under cp_rows (in place,
    idempotent); returns their names."""
    done = []
    for name, mod in model.named_modules():
        if _dynamic(mod) and type(mod) not in _CLASSES.values():
            mod.__class__ = _cp_class(type(mod))
            done.append(name)
    return done
