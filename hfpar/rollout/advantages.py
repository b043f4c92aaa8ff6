"""Advantages from the rewards of a generation batch: rows are prompt-major (the `num_generations` completions of a
prompt next to each other), as TRL 1.16's GRPOTrainer and RLOOTrainer lay them out.

    rewards = weighted_rewards(per_func, weights)         # (N,), NaN where every reward function returned None
    adv, stats = group_advantages(rewards, num_generations, scale_rewards="group")   # GRPO
    adv, stats = rloo_advantages(rewards, num_generations, normalize=False)           # RLOO

They take the whole generation batch (every rank's completions: rewards are gathered before this, as in TRL), so the
advantage of a completion does not depend on how the batch is split over ranks.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (TRL's trainer.utils.nanstd: Bessel's correction over the count)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = torch.sum(~torch.isnan(x), dim=dim)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    return torch.sqrt(var * correction)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards of F functions (NaN: a function returned None) -> (N,) their weighted sum, NaN where every
    function returned None (an unscorable completion: no advantage, TRL's rule)."""
    rewards = (per_func * weights.to(per_func).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO: reward minus its group's mean, divided by the group's std (group), the batch's std (batch) or 1 (none).
    -> (advantages (N,), {"std": the std used or logged per row, "std_is_zero": (N,) bool})."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}: valid values are {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0), {"std": std, "std_is_zero": torch.isclose(std, torch.zeros_like(std))}


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """RLOO: reward minus the mean of its group's other (scorable) completions; normalize: then standardized over the
    batch. A group with one scorable completion, and unscorable rows, get 0."""
    grouped = rewards.view(-1, num_generations)
    if num_generations > 1:
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
        adv = rewards - baseline.view(-1)
    else:
        adv = torch.zeros_like(rewards)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0)
