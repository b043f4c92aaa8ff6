"""Which calls of a CPU run would make the host wait for the device on CUDA (a host sync).

    with HostSyncs() as seen:
        loss = model(x).sum(); loss.backward()
    assert seen.ops == []                     # e.g. ["aten.bincount.default"] or ["Tensor.tolist"] where one slipped in

A CPU run cannot time a sync, but it makes the same calls as a CUDA run of the same code path. Seen here:
- a tensor read as a Python value: .item(), .tolist(), int(), float(), bool(), use as an index, .numpy(), .cpu()
  (tensor methods, seen as torch functions: a CPU tensor's .tolist() reaches no op);
- ops whose CUDA output is sized by the data (nonzero, bincount, unique, masked_select, boolean-mask indexing,
  repeat_interleave without output_size) or returned to Python (equal), seen at the dispatcher, backward included.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READ_AS_PYTHON = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"}
SIZED_BY_DATA = {
    "nonzero",
    "argwhere",
    "bincount",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "masked_select",
    "equal",
    "is_nonzero",
    "_local_scalar_dense",
}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _Reads(TorchFunctionMode):
    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READ_AS_PYTHON:
            self.ops.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _Sized(TorchDispatchMode):
    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        # repeat_interleave(repeats tensor): its output length is repeats.sum(), read on the host unless given
        sized = name == "repeat_interleave" and func._overloadname == "Tensor"
        sized = sized and kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
        if name in SIZED_BY_DATA or sized or (name in BOOL_INDEXED and _bool_index(args)):
            self.ops.append(str(func))
        return func(*args, **kwargs)


class HostSyncs:
    """Records (as `ops`, in order) every call that reads the device on the host under CUDA."""

    def __init__(self):
        self.ops: list[str] = []
        self._modes = (_Reads(self.ops), _Sized(self.ops))

    def __enter__(self) -> HostSyncs:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
