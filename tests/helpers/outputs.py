"""Reading what runs and checkpoints leave on disk, for tests at every level.

tensorboard_scalars(out, "loss")   # [(step, value)] from Accelerate's tensorboard event files
checkpoint_bytes(index)            # fp32 bytes of every tensor a checkpoint index names
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def tensorboard_scalars(output_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar from every tensorboard event file under output_dir (Accelerate's
    TensorBoardTracker writes to <project_dir>/<run name>/ with project_dir = --output_dir)."""
    # tensorboard is a test extra, and its event reader is slow to import: only the tests that read events pay it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for f in sorted(Path(output_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            points += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(points)


def checkpoint_bytes(index: dict) -> int:
    """fp32 bytes of every tensor of a checkpoint ({key: file} as hfpar.loading.files.checkpoint_index gives)."""
    total = 0
    for key, path in index.items():
        with safe_open(path, "pt") as f:
            total += torch.Size(f.get_slice(key).get_shape()).numel() * 4
    return total
