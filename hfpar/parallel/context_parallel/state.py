"""The batch's row layout, cp group and mode, published to the attention function for a forward and its backward (per
thread: the emulated ranks of shard_check.py are threads of one process).

    with cp_rows(rows, cp_group, mode="ring"):   # forward AND backward (checkpoint recompute)
        ...
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .layout import RowLayout

MODES = ("ring", "ulysses")
_state = threading.local()


@contextlib.contextmanager
def cp_rows(rows: RowLayout, group, mode: str):
    """Publish the current batch's row layout, cp group and mode to the attention function."""
    if mode not in MODES:
        raise ValueError(f"cp_mode {mode!r}: valid values are {', '.join(MODES)}")
    previous = getattr(_state, "cur", None)
    _state.cur = (rows, group, mode)
    try:
        yield
    finally:
        _state.cur = previous


@contextlib.contextmanager
def cp_row_slice(start: int, stop: int):
    """Inside `cp_rows(...)`: publish the layout of rows start:stop only, same group and mode (a pipeline
    micro-batch's forward and backward); outside one, nothing to narrow."""
    state = getattr(_state, "cur", None)
    if state is None:
        yield
        return
    with cp_rows(state[0].row_slice(start, stop), state[1], state[2]):
        yield


def current_layout() -> RowLayout | None:
    """Inside cp_rows (this thread): the batch's RowLayout, else None."""
    state = getattr(_state, "cur", None)
    return None if state is None else state[0]


def current_tops() -> torch.Tensor | None:
    """Inside cp_rows: the (B,) largest position id of each whole row (rotary.py), else None."""
    rows = current_layout()
    return None if rows is None else rows.tops
