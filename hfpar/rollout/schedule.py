"""Which prompts a GRPO run generates for, when, and which completion rows each data-parallel rank trains on: a
function of (seed, step) and the global batch, never of the mesh.

    sched = RolloutSchedule(num_prompts=500, num_generations=8, per_device=4, dp=2, accum=2,
                            steps_per_generation=2, num_iterations=1, seed=42)
    w, k = sched.position(step)             # the generation window of an optimizer step, and its step in the pass
    prompts = sched.prompts(w)              # dataset indices of the window's prompts (prompt-major rows)
    rows = sched.rank_rows(dp_rank)         # per micro-step of the window: this rank's global row numbers

TRL 1.16 GRPOTrainer's names: a generation batch holds `per_device x dp x steps_per_generation` completions,
`num_generations` per prompt (rows prompt-major: the completions of a prompt next to each other); it is trained
`num_iterations` times, `steps_per_generation` micro-steps each pass, `accum` micro-steps per optimizer step. Micro-step
m of a pass gives dp rank r the rows [(m * dp + r) * per_device, + per_device): one process with per_device x dp rows
per micro-step trains on the same rows. (TRL also shuffles the rows inside a generation batch before splitting it;
the step's loss sums and gradients are the same in any order, so hfpar keeps them in place.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RolloutSchedule:
    num_prompts: int
    num_generations: int
    per_device: int  # completions per dp rank per micro-step (TRL's per_device_train_batch_size)
    dp: int
    accum: int
    steps_per_generation: int
    num_iterations: int
    seed: int
    shuffle: bool = True

    @property
    def generation_batch(self) -> int:
        """Completions per generation (TRL's generation_batch_size)."""
        return self.per_device * self.dp * self.steps_per_generation

    @property
    def prompts_per_window(self) -> int:
        return self.generation_batch // self.num_generations

    @property
    def steps_per_pass(self) -> int:
        return self.steps_per_generation // self.accum

    @property
    def steps_per_window(self) -> int:
        return self.steps_per_pass * self.num_iterations

    @property
    def windows_per_epoch(self) -> int:
        return self.num_prompts // self.prompts_per_window

    @property
    def rows_per_epoch(self) -> int:
        """Completion rows trained per epoch (each generation batch num_iterations times): the length of the
        training set as the trainer's sampler counts it."""
        return self.windows_per_epoch * self.generation_batch * self.num_iterations

    def problems(self) -> list[str]:
        """One line each; the options named as the user gave them."""
        p = []
        if self.num_generations < 2:
            p.append(
                f"--num_generations {self.num_generations}: must be >= 2 (advantages compare a prompt's completions)"
            )
        elif self.generation_batch % self.num_generations:
            p.append(
                f"--num_generations {self.num_generations} does not divide the generation batch of "
                f"{self.generation_batch} completions (per_device_train_batch_size {self.per_device} x dp {self.dp} x "
                f"steps_per_generation {self.steps_per_generation}): pick a divisor"
            )
        if self.steps_per_generation % self.accum:
            p.append(
                f"--steps_per_generation {self.steps_per_generation}: must be a multiple of "
                f"--gradient_accumulation_steps {self.accum} (a generation batch covers whole optimizer steps)"
            )
        if self.num_iterations < 1:
            p.append(f"--num_iterations {self.num_iterations}: must be >= 1")
        if not p and self.windows_per_epoch == 0:
            p.append(
                f"the dataset has {self.num_prompts} prompts, fewer than one generation batch needs "
                f"({self.prompts_per_window} prompts x {self.num_generations} generations)"
            )
        return p

    def position(self, step: int) -> tuple[int, int]:
        """(window, optimizer step within the current pass over the window) of a 0-based optimizer step."""
        return step // self.steps_per_window, (step % self.steps_per_window) % self.steps_per_pass

    def prompts(self, window: int) -> list[int]:
        """The window's prompts (dataset indices), an epoch's permutation (seed + epoch) cut in windows."""
        epoch, w = divmod(window, self.windows_per_epoch)
        if self.shuffle:
            perm = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            perm = torch.arange(self.num_prompts)
        return perm[w * self.prompts_per_window : (w + 1) * self.prompts_per_window].tolist()

    def rank_rows(self, dp_rank: int) -> list[list[int]]:
        """This rank's global row numbers, one list per micro-step of a pass."""
        b = self.per_device
        return [
            list(range((m * self.dp + dp_rank) * b, (m * self.dp + dp_rank + 1) * b))
            for m in range(self.steps_per_generation)
        ]

    def row(self, window_prompts: list[int], row: int) -> tuple[int, int]:
        """(dataset index of its prompt, generation index) of a global row."""
        return window_prompts[row // self.num_generations], row % self.num_generations
