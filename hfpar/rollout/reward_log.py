"""What a reward function gets besides the completions, as TRL 1.16 GRPOTrainer passes it: `trainer_state` (a
transformers TrainerState of the run's progress), `log_metric(name, value)` (a scalar, averaged over the calls of a
generation batch and the ranks: a field of the step's record in metrics.jsonl) and `log_extra(column, values)` (one
value per completion of the call: a column of completions.jsonl with --log_completions).

    progress = RunProgress(max_steps=60, steps_per_epoch=32, ...)
    log = RewardLog()
    f(prompts, completions, completion_ids, trainer_state=progress.state(step), log_metric=log.log_metric,
      log_extra=log.log_extra, **columns)
    fields = log.metrics(device)              # collective: {name: mean over every call of every rank}
    columns = log.extra(rows)                 # collective: {column: {global row: value}}

Only the rank that leads a replica scores (hfpar.rollout.loop), so the others take part in the collectives with
nothing pending, as TRL's processes do with no reward function call of their own.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.trainer_callback import TrainerState

from hfpar.distributed import all_reduce_sum, process_rank


@dataclass(frozen=True)
class RunProgress:
    """The run's numbers a TrainerState carries (TRL's Trainer fills the same fields)."""

    max_steps: int
    steps_per_epoch: int  # optimizer steps over one pass of the rollout's rows (the trainer's sampler's)
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 1  # per device (TRL: per_device_train_batch_size x GPUs of the process)

    def state(self, global_step: int) -> TrainerState:
        """The TrainerState as TRL's reward functions see it before step `global_step` + 1 (steps completed:
        global_step; epoch: the fraction of an epoch they trained, as transformers' Trainer counts it)."""
        return TrainerState(
            epoch=global_step / self.steps_per_epoch,
            global_step=global_step,
            max_steps=self.max_steps,
            # transformers' Trainer: the epochs max_steps takes
            num_train_epochs=math.ceil(self.max_steps / self.steps_per_epoch),
            logging_steps=self.logging_steps,
            eval_steps=self.eval_steps,
            save_steps=self.save_steps,
            train_batch_size=self.train_batch_size,
            is_world_process_zero=process_rank() == 0,
            is_local_process_zero=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        )


class RewardLog:
    """The values reward functions log during one generation batch's scoring (or one evaluation's), until
    flushed."""

    def __init__(self):
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._extra: dict[str, list] = defaultdict(list)
        self._rows: list[int] = []  # the global row of each completion scored, in call order

    def log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self._extra[column].extend(values)

    def scored(self, rows: list[int]) -> None:
        """The global rows of the completions of the calls just made (a column a call did not log: None)."""
        n = len(self._rows)
        for values in self._extra.values():
            values.extend([None] * (n - len(values)))
        self._rows += rows

    def metrics(self, device) -> dict[str, float]:
        """Collective: each logged name's mean over every call of every rank (TRL: sum / count over processes)."""
        names = sorted(set().union(*_gather(list(self._metrics))))
        out = {}
        if names:
            local = [x for k in names for x in (sum(self._metrics.get(k, [])), len(self._metrics.get(k, [])))]
            total = all_reduce_sum(torch.tensor(local, dtype=torch.float64), device).view(-1, 2).tolist()
            out = {k: s / c for k, (s, c) in zip(names, total) if c}
        self._metrics.clear()
        return out

    def extra(self) -> dict[str, dict[int, object]]:
        """Collective: {column: {global row: value}} of every rank's calls (None where a call did not log it)."""
        n = len(self._rows)
        mine = {k: dict(zip(self._rows, v + [None] * (n - len(v)))) for k, v in self._extra.items()}
        out: dict[str, dict[int, object]] = defaultdict(dict)
        for part in _gather(mine):
            for k, v in part.items():
                out[k].update(v)
        self._extra.clear()
        self._rows = []
        return dict(out)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(obj) -> list:
    """Every rank's `obj` (this run's own values: names, the columns' values), in rank order."""
    if not _dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
