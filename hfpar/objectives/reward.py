"""The reward-model objective: TRL 1.16 RewardTrainer's loss and metrics, an Objective of hfpar's one training loop.

    objective = RewardObjective(center_rewards_coefficient=0.01)
    objective.before_micro(backend, batch, replan)   # takes the pairs' margins (no model input) out of the batch
    loss_sum, n_pairs = objective(logits, labels)   # logits (2P, 1): the P chosen rows' rewards, then the rejected

Rows come from hfpar.data.reward_pairs.RewardCollator: a micro-batch of P pairs is 2P rows, chosen first; labels
(2P,) mark the real pairs (IGNORE: an eval padding slot). Per pair (TRL's compute_loss):
    loss = -log sigmoid(r_chosen - r_rejected [- margin]) [+ center_rewards_coefficient * (r_chosen + r_rejected)^2]

Normalization (the parity contract for preference losses): the loss of an optimizer step is the mean over the
pairs of the whole global batch. The loss function returns the SUM of per-pair losses and the number of pairs,
and the trainer divides the step's sums by the global pair count (count()); so any dp layout and accumulation
computes the one-process step. Metrics (TRL's names): accuracy (r_chosen > r_rejected), margin (r_chosen -
r_rejected), mean_reward over the pairs of the global batch, and min_reward / max_reward over its rewards (one
MAX all-reduce a step, over every rank); eval_* the same over the eval pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.distributed import all_reduce_sum
from hfpar.objectives.base import Objective
from hfpar.parallel.labels import IGNORE

SUMS = ("accuracy", "margin", "mean_reward")  # then the pair count; then max and -min (the extremes)


def pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None, center: float | None
) -> torch.Tensor:
    """(P,) per-pair losses of TRL 1.16's RewardTrainer (its batch mean is TRL's loss). chosen, rejected (P,)."""
    delta = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(delta)
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class RewardObjective(Objective):
    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient
        self.margin = None  # (P,) the current micro-batch's margins, or None
        self.reset_metrics()

    # ------------------------------------------------------------------ units
    @staticmethod
    def count(batch: dict) -> float:
        """Real pairs of a micro-batch (its chosen rows' labels), as the trainer sums them over ranks."""
        labels = batch["labels"]
        return int((labels[: labels.shape[0] // 2] != IGNORE).sum())

    @staticmethod
    def tokens(sample: dict) -> int:
        """Real tokens of a pair's two rows (tokens/s)."""
        return len(sample["chosen_ids"]) + len(sample["rejected_ids"])

    def padding_sample(self, sample: dict) -> dict:
        """An eval padding slot: the collator gives its rows IGNORE labels."""
        sample["no_targets"] = True
        return sample

    # ------------------------------------------------------------------ the step
    def before_micro(self, backend, batch: dict, replan) -> None:
        """The micro-batch's margins (P,) taken out of the batch (the model gets input_ids and attention_mask)."""
        margin = batch.pop("margin", None)
        self.margin = None if margin is None else margin.to(batch["input_ids"].device)

    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the pairs' losses, pairs). out (2P, 1) rewards, fp32 at least; labels (2P,)."""
        rewards = out.squeeze(-1)
        rewards = rewards.float() if rewards.dtype in (torch.float16, torch.bfloat16) else rewards
        chosen, rejected = rewards.chunk(2)  # (P,), (P,)
        real = labels[: chosen.shape[0]] != IGNORE
        margin = None if self.margin is None else self.margin.to(rewards.dtype)
        losses = torch.where(real, pair_losses(chosen, rejected, margin, self.center), 0)
        self._record(chosen.detach().double(), rejected.detach().double(), real)
        return losses.sum(), real.sum(dtype=torch.float64)

    # ------------------------------------------------------------------ metrics
    def reset_metrics(self) -> None:
        self._sums = None  # (len(SUMS) + 1,) float64 on the device once a pair is recorded
        self._extremes = None  # (2,) max reward, -min reward

    def _record(self, chosen: torch.Tensor, rejected: torch.Tensor, real: torch.Tensor) -> None:
        """Adds the pairs' metric sums on the device (no host sync: read once per step)."""
        c, r = torch.where(real, chosen, 0), torch.where(real, rejected, 0)
        s = torch.stack(
            [
                ((chosen > rejected) & real).double().sum(),
                (c - r).sum(),
                (c + r).sum(),
                real.double().sum(),
            ]
        )
        both = torch.cat([chosen, rejected])
        mask = torch.cat([real, real])
        e = torch.stack([torch.where(mask, both, -torch.inf).max(), torch.where(mask, -both, -torch.inf).max()])
        self._sums = s if self._sums is None else self._sums + s
        self._extremes = e if self._extremes is None else torch.maximum(self._extremes, e)

    def step_sums(self, device) -> torch.Tensor:
        """This rank's sums of the step and the extremes of every rank (a MAX all-reduce: collective), divided by the
        world size so that the trainer's sum over the ranks gives them back; then reset."""
        s = self._sums if self._sums is not None else torch.zeros(len(SUMS) + 1, dtype=torch.float64, device=device)
        e = self._extremes
        e = e.clone() if e is not None else torch.full((2,), -torch.inf, dtype=torch.float64, device=device)
        world = _world()
        if world > 1:
            dist.all_reduce(e, op=dist.ReduceOp.MAX)
        self.reset_metrics()
        return torch.cat([s, e / world])

    @staticmethod
    def metrics(sums: list[float]) -> dict:
        """TRL's metric names from the reduced sums: accuracy, margin and mean_reward over the pairs of the global
        batch (ranks holding the same pairs, tp, count them alike: the ratios are unaffected), min / max_reward."""
        n = sums[len(SUMS)]
        if not n:
            return {}
        out = {"accuracy": sums[0] / n, "margin": sums[1] / n, "mean_reward": sums[2] / (2 * n)}
        return {**out, "min_reward": -sums[-1], "max_reward": sums[-2]}

    # ------------------------------------------------------------------ evaluation
    def begin_eval(self) -> None:
        """The eval's sums apart from the training step's."""
        self._train_state = (self._sums, self._extremes)
        self.reset_metrics()

    def end_eval(self, device) -> dict:
        """The eval's metrics with TRL's names (eval_accuracy, eval_margin, ...; collective), the training sums
        restored. eval_accuracy replaces the classify task's argmax accuracy, meaningless for one logit."""
        out = {f"eval_{k}": v for k, v in self.metrics(all_reduce_sum(self.step_sums(device), device).tolist()).items()}
        self._sums, self._extremes = self._train_state
        return out
