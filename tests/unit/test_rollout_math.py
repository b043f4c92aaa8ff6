"""GRPO's advantages and policy loss against TRL 1.16's own code (GRPOTrainer._compute_loss, its advantage block,
RLOOTrainer's leave-one-out baseline), on random log-probs, every loss type, token and sequence importance sampling,
beta 0 and > 0: loss, gradient and clip ratios equal within 1e-6.

    python -m pytest -q tests/unit/test_rollout_math.py
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd as trl_nanstd

from hfpar.rollout.advantages import group_advantages, nanstd, rloo_advantages, weighted_rewards
from hfpar.rollout.policy_loss import LOSS_TYPES, PolicyLossConfig, aggregate, clip_stats, policy_terms

B, T, L = 6, 7, 9  # completions, completion length, max_completion_length


class _Acc:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _trl_loss(cfg: PolicyLossConfig, logps, inputs):
    """TRL's _compute_loss on a stand-in trainer whose forward returns `logps` (one process, one micro-batch)."""
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=cfg.importance_sampling_level,
        beta=cfg.beta,
        loss_type=cfg.loss_type,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.eps_high,
        args=types.SimpleNamespace(
            delta=cfg.delta, use_bias_correction_kl=cfg.use_bias_correction_kl, steps_per_generation=1
        ),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=cfg.max_completion_length,
        accelerator=_Acc(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, fake._metrics["train"]


CASES = [
    (lt, lvl, beta, delta)
    for lt in LOSS_TYPES
    for lvl in ("token", "sequence")
    for beta in (0.0, 0.04)
    for delta in (None,)
] + [("grpo", "token", 0.04, 1.5), ("dapo", "token", 0.0, 1.5)]


@pytest.mark.parametrize("loss_type,level,beta,delta", CASES)
def test_policy_loss_equals_trl(loss_type, level, beta, delta):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[:, 0] = 1
    old = -torch.rand(B, T, generator=g) * 3
    logps = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)  # some ratios outside the clip range
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    cfg = PolicyLossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        delta=delta,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        max_completion_length=L,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    want, metrics = _trl_loss(cfg, logps, inputs)
    (want_grad,) = torch.autograd.grad(want, logps)
    terms = policy_terms(logps, old, ref if beta else None, adv, mask, cfg)
    loss_sum, units = aggregate(terms.per_token_loss, mask, cfg)
    got = loss_sum / units
    (got_grad,) = torch.autograd.grad(got, logps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)
    for name, (s, n) in clip_stats(terms, adv, mask, cfg).items():
        assert abs(float(s / n) - metrics[name][0]) < 1e-6, name
    if beta:
        assert abs(float((terms.kl.detach() * mask).sum() / mask.sum()) - metrics["kl"][0]) < 1e-6


def _trl_group_advantages(rewards_per_func, weights, G, scale):
    """TRL 1.16 GRPOTrainer's sum_then_normalize block (grpo_trainer.py), verbatim in substance."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = (
        trl_nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        if scale != "batch"
        else trl_nanstd(rewards).expand_as(rewards)
    )
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    g = torch.Generator().manual_seed(1)
    per_func = torch.randint(0, 3, (12, 2), generator=g).float()
    per_func[3, 0] = torch.nan  # one function returned None
    per_func[7] = torch.nan  # unscorable
    weights = torch.tensor([1.0, 0.5])
    got, stats = group_advantages(weighted_rewards(per_func, weights), 4, scale)
    torch.testing.assert_close(got, _trl_group_advantages(per_func, weights, 4, scale))
    assert got[7] == 0 and stats["std_is_zero"].dtype == torch.bool


def test_rloo_advantages_and_nanstd():
    rewards = torch.tensor([1.0, 0.0, 2.0, torch.nan, 3.0, 3.0, 1.0, 5.0])
    adv = rloo_advantages(rewards, 4)
    # prompt 0: scorable 1, 0, 2 -> baselines (0+2)/2, (1+2)/2, (1+0)/2; the unscorable row gets 0
    torch.testing.assert_close(adv[:4], torch.tensor([0.0, -1.5, 1.5, 0.0]))
    torch.testing.assert_close(adv[4:], torch.tensor([3 - 3.0, 3 - 3.0, 1 - 11 / 3, 5 - 7 / 3]))
    x = torch.tensor([[1.0, 2.0, torch.nan, 4.0], [1.0, torch.nan, torch.nan, torch.nan]])
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1), equal_nan=True)
