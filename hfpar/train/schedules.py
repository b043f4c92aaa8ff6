"""Learning-rate schedules with transformers' names and formulas (linear, cosine, constant,
constant_with_warmup, cosine_with_min_lr), as a torch LambdaLR.

tests/unit/test_schedules.py pins these to transformers' own schedules, step by step.
why: docs/architecture.md#why-the-training-loop
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim.lr_scheduler import LambdaLR

MIN_LR_RATE = 0.1  # cosine_with_min_lr: the floor as a fraction of the peak lr (TRL recipes' usual choice)


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int, min_lr_rate: float = 0.0) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _constant(step: int, *, warmup: int, total: int) -> float:  # noqa: ARG001
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:  # noqa: ARG001
    return _warmup(step, warmup) if step < warmup else 1.0


SCHEDULES = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "cosine_with_min_lr": partial(_cosine, min_lr_rate=MIN_LR_RATE),
}


def get_scheduler(name: str, optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    if name not in SCHEDULES:
        raise ValueError(f"lr scheduler {name!r}: valid values are {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, partial(SCHEDULES[name], warmup=num_warmup_steps, total=num_training_steps))
