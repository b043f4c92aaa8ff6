"""Bytes of the tensors autograd saves for backward during a call, parameters excluded (exact, not estimated).

    nbytes, out = saved_tensor_bytes(model, lambda: model(input_ids=ids).logits)
    with LiveSavedBytes(model) as live: ...forwards and backwards...; live.peak   # most bytes alive at once

Tensors saved twice (same storage) count once. Shared by tensor_parallel/activation_memory.py,
context_parallel/scaling.py and pipeline/schedules.py.
"""

from __future__ import annotations

import contextlib
import weakref

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


class LiveSavedBytes(contextlib.AbstractContextManager):
    """The peak, over the block, of the bytes of saved-for-backward tensors alive at once (parameters excluded): a
    tensor counts from the forward that saves it until autograd (or the caller) drops its last reference."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if key not in self.live:
            self.live[key] = [0, t.untyped_storage().nbytes()]
            self.current += self.live[key][1]
            self.peak = max(self.peak, self.current)
        self.live[key][0] += 1
        weakref.finalize(t, self._release, key)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
