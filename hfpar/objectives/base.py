"""The objective: what the one training loop optimizes, and every hook it calls, declared here with its default
(the token-normalized causal-LM / classification loss of hfpar.train.losses).

    objective = Objective.for_task("lm", model)      # after parallelize (a vocab-parallel or chunked head)
    loss_sum, n = objective(logits, shifted_labels)  # the trainer divides the step's sums by count() over ranks

A recipe with another loss subclasses Objective and overrides what differs (hfpar.objectives.preference: DPO,
whose unit is the pair and which owns a reference model). The trainer calls, in this order:
    bind(model)                           after the data-parallel wrap (the parameters the run trains)
    prepare(backend, batches)             before training and before resume (e.g. precomputed reference values)
    step_samples(backend, step, micro, ds) the samples of an optimizer step's micro-batches (default: the dataset's
                                          items through sample(); online RL: its rollouts, generated here)
    sample(split, index, sample)          every dataset item the trainer reads ("train" / "eval")
    padding_sample(sample)                an eval padding slot (same shapes, no targets)
    count(batch), tokens(sample)          the normalization units of a micro-batch; real tokens of a sample
    empty_step_units(step)                a step whose global batch has no units: raise, or the units to use
    before_micro(backend, batch, replan)  before each micro-batch's forward (train and eval)
    __call__(out, labels)                 (loss sum, units) of a forward; `scope(labels)` around it if not None
    step_sums(device) / metrics(sums)     extra sums reduced with the step's loss -> fields of its record
    begin_eval() / end_eval(device)       around an evaluation -> fields of the eval record
    evaluate(backend, batches, dataset)   an evaluation of its own instead (online RL: generation on eval prompts)
    state_dict() / load_state_dict(state) what a checkpoint keeps of the objective (tensors; safetensors, no pickle)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from hfpar.parallel.labels import IGNORE
from hfpar.train.losses import count_targets, make_loss_fn

# the micro-batches a run will train on (or its eval batches), in order: (dataset indices (None: an eval padding
# slot), plan) where plan() collates them onto the device -> (planned batch, scope)
Batches = Callable[[], Iterator[tuple[list, Callable[[], tuple[dict, contextlib.AbstractContextManager]]]]]


class Objective:
    scope: Callable[[torch.Tensor], contextlib.AbstractContextManager] | None = None
    # step_samples reads the dataset only (a function of the step's indices): the trainer may load a step's batches
    # while earlier steps train (hfpar.train.prefetch); False where they depend on the weights (rollouts)
    samples_from_data: bool = True

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
        """loss(out, labels) -> (loss sum, units); its `scope` (a chunked LM head's) is the objective's."""
        self.loss = loss
        self.scope = getattr(loss, "scope", None)

    @classmethod
    def for_task(cls, task: str, model: torch.nn.Module) -> Objective:
        """The task's token-summed loss (hfpar.train.losses.make_loss_fn: vocab-parallel / chunked where the
        model's head is)."""
        return cls(make_loss_fn(task, model))

    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss(out, labels)

    # ------------------------------------------------------------------ the run's set-up
    def bind(self, model: torch.nn.Module) -> None:
        """The model as the backend prepared it (wrapped, sharded), before any step."""

    def prepare(self, backend, train_batches: Batches, eval_batches: Batches) -> None:
        """Before the first step and before resume loads a checkpoint (the model is still the initial one)."""

    # ------------------------------------------------------------------ samples and units
    def step_samples(self, backend, step: int, micro: list[list[int]], dataset) -> list[list[dict]]:
        """The samples of optimizer step `step` (0-based), one list per micro-batch: by default the dataset items
        the sampler chose (`micro`: this rank's indices per accumulation step). Collective where it generates."""
        return [[self.sample("train", i, dataset[i]) for i in ix] for ix in micro]

    def sample(self, split: str, index: int, sample: dict) -> dict:
        """A dataset item as the collator gets it (split: "train" | "eval")."""
        return sample

    def padding_sample(self, sample: dict) -> dict:
        """An eval padding slot made of `sample` (a copy): the same shapes, no targets."""
        lab = sample["labels"]
        sample["labels"] = [IGNORE] * len(lab) if isinstance(lab, list) else IGNORE
        return sample

    def count(self, batch: dict) -> float:
        """The units the loss of a (planned) micro-batch is normalized by, as the trainer sums them over ranks."""
        return count_targets(batch)

    def tokens(self, sample: dict) -> int:
        """Real tokens of a sample (tokens/s)."""
        return len(sample["input_ids"])

    def empty_step_units(self, step: int) -> float:
        """The units to divide by when a training step's global batch has none (every target masked): by default
        an error, since for data read from a dataset it is a data bug; an objective whose rows may all be masked by
        design returns a count (online RL: every completion truncated, TRL's clamp to 1: a zero-loss step)."""
        raise ValueError(
            f"step {step + 1}: the global batch has no target tokens (all labels masked); check the data / "
            "--completion_only_loss"
        )

    # ------------------------------------------------------------------ the step
    def before_micro(self, backend, batch: dict, replan: Callable[[], tuple[dict, object]]) -> None:
        """Before a micro-batch's forward (in place on `batch`); replan() -> the same rows planned again with a
        fresh scope, for a forward of its own (a reference model's)."""

    def step_sums(self, device: torch.device) -> torch.Tensor:
        """(k,) float64 sums of this rank's step, all-reduced with the loss (one collective a step), then reset."""
        return torch.zeros(0, dtype=torch.float64, device=device)

    def metrics(self, sums: Iterable[float]) -> dict:
        """Fields of the step's record from the reduced step_sums."""
        return {}

    # ------------------------------------------------------------------ evaluation
    def begin_eval(self) -> None:
        """An evaluation starts (its sums apart from the training step's)."""

    def end_eval(self, device: torch.device) -> dict:
        """Fields of the eval record (collective: every rank calls it)."""
        return {}

    def evaluate(self, backend, batches: list[list[int | None]], dataset) -> dict | None:
        """The objective's own evaluation (collective; `batches`: this rank's eval batches by dataset index, None a
        padding slot, every rank the same number) -> the eval record; None: the trainer's, the loss over them."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """What resume needs of the objective beyond the model and optimizer (e.g. a rollout buffer): tensors, the
        same on every rank (the main process writes them)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Resume: what state_dict() returned, on every rank."""


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout module's p to 0, LoRA's included (TRL's disable_dropout_in_model, applied after get_peft_model:
    DPOConfig / RewardConfig default true, GRPOConfig false). Attention dropout a config passes to the attention
    function as a number is not a module: untouched, as in TRL."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
