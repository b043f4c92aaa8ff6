"""Deterministic, resumable global-batch sampling sharded by data-parallel rank.

The global batch of optimizer step s in epoch e is a fixed slice of one seeded permutation:
    perm_e = randperm(n, seed + e);   G = perm_e[s*B : (s+1)*B],  B = per_device * dp * accum
Micro-step m of dp rank r takes G[(m*dp + r)*per_device : ... + per_device]. With `splits` s > 1 (the pipeline's
micro-batches, each per_device / s rows) it takes the s parts G[m*dp*per_device + (i*dp + r)*per_device/s ...]
instead, so that the i-th micro-batch of every dp rank together is one contiguous slice of G: the rows a
one-process micro-step of dp*per_device/s rows sees (MoE routing statistics are per micro-batch). So the union of
samples in a global batch is the same for every (dp, accum) split of the same B, which is what
makes a 2-rank run comparable to a 1-rank run step for step. TP ranks of one replica share the
dp rank, hence the same batches. Resuming at (epoch, step) jumps there in O(1): no batch is
replayed or skipped and nothing is iterated through.
The last incomplete global batch of an epoch is dropped (same rule for every world size).
"""

from __future__ import annotations

import math

import torch


def total_steps(max_steps: int, num_train_epochs: float, steps_per_epoch: int) -> int:
    """A run's optimizer steps: --max_steps when > 0, else its epochs' (at least one)."""
    return max_steps if max_steps > 0 else max(1, math.ceil(num_train_epochs * steps_per_epoch))


class GlobalBatchSampler:
    def __init__(
        self,
        num_samples: int,
        per_device: int,
        dp: int,
        dp_rank: int,
        accum: int,
        seed: int,
        shuffle: bool = True,
        splits: int = 1,
    ):
        self.n = num_samples
        self.splits = splits if splits >= 1 and per_device % splits == 0 else 1
        self.per_device, self.dp, self.dp_rank, self.accum = per_device, dp, dp_rank, accum
        self.global_batch = per_device * dp * accum
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one global batch of {self.global_batch} "
                f"(per_device_train_batch_size {per_device} x dp {dp} x gradient_accumulation_steps {accum})"
            )

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g)

    def micro_batches(self, epoch: int, step_in_epoch: int) -> list[list[int]]:
        """This rank's `accum` micro-batches (lists of dataset indices) for one optimizer step."""
        perm = self._perm(epoch)
        start = step_in_epoch * self.global_batch
        out = []
        part = self.per_device // self.splits
        for m in range(self.accum):
            rows = []
            for i in range(self.splits):
                off = start + m * self.dp * self.per_device + (i * self.dp + self.dp_rank) * part
                rows += perm[off : off + part].tolist()
            out.append(rows)
        return out

    def iterate(self, start_step: int, total_steps: int):
        """Yield (global_step, epoch, micro_batches) from start_step (0-based) to total_steps."""
        for step in range(start_step, total_steps):
            epoch, in_epoch = divmod(step, self.steps_per_epoch)
            yield step, epoch, self.micro_batches(epoch, in_epoch)


def eval_shard(num_samples: int, batch_size: int, dp: int, dp_rank: int) -> list[list[int | None]]:
    """Eval batches for this rank. Every rank gets the same number of batches (sharded backends
    need matching collectives); missing slots are None and are filled with a masked dummy."""
    per_round = batch_size * dp
    rounds = -(-num_samples // per_round)
    out = []
    for r in range(rounds):
        base = r * per_round + dp_rank * batch_size
        out.append([i if i < num_samples else None for i in range(base, base + batch_size)])
    return out
