"""Bytes of the tensors autograd saves for backward during a call, parameters excluded (exact, not estimated).

    nbytes, out = saved_tensor_bytes(model, lambda: model(input_ids=ids).logits)

Tensors saved twice (same storage) count once. Shared by tp_activation_memory.py and context_parallel.py.
"""

from __future__ import annotations

import torch


def saved_tensor_bytes(model: torch.nn.Module, fn):
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out
