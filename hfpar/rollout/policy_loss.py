"""The policy-gradient loss of GRPO and its variants, per token, with TRL 1.16 GRPOTrainer's semantics and names.

    terms = policy_terms(logps, old_logps, ref_logps, advantages, mask, cfg)     # (B, T) tensors, detached metrics
    loss_sum, units = aggregate(terms.per_token_loss, mask, cfg)                  # this micro-batch's share

`aggregate` splits TRL's per-loss-type normalization into a sum and the units it is divided by, so that the optimized
loss of a step is sum over the whole global batch / units over the whole global batch (hfpar's global normalization),
whatever the ranks and accumulation steps:
    dapo, cispo  tokens: sum of per-token losses / completion tokens of the global batch (TRL's num_items_in_batch)
    bnpo         tokens, like dapo (TRL normalizes by the tokens of each local micro-batch: the same with one
                 micro-batch per step; over several it is the mean of per-micro-batch means, which depends on how the
                 batch is cut, so hfpar keeps the mesh-independent token mean)
    grpo         sequences: each completion's mean per-token loss, averaged over the completions
    dr_grpo      sequences x max_completion_length: the sum of per-token losses / (completions x L)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_type: str = "dapo"  # TRL's default
    importance_sampling_level: str = "token"
    epsilon: float = 0.2  # epsilon_low
    epsilon_high: float | None = None  # None: epsilon, for every loss type (TRL's rule; for cispo TRL suggests 5.0)
    delta: float | None = None  # two-sided clipping's upper bound on the ratio
    beta: float = 0.0  # KL coefficient (0: no reference)
    use_bias_correction_kl: bool = True  # TRL 1.16's default: the KL term times the importance ratio
    max_completion_length: int = 256  # dr_grpo's constant
    temperature: float = 1.0  # the sampler's: log-probs and entropies are of softmax(logits / temperature) (TRL's)

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class PolicyTerms:
    per_token_loss: torch.Tensor  # (B, T), or (B, 1) with sequence-level weights and no KL term
    ratio: torch.Tensor  # coef_1: (B, T) token level, (B, 1) sequence level
    kl: torch.Tensor | None  # (B, T) per-token k3 KL, None where beta == 0


def policy_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyTerms:
    """logps / old_logps / ref_logps: (B, T) log-probs of the completion tokens under the policy (with grad), the
    policy that generated them, the reference; advantages (B,); mask (B, T) 1 for completion tokens."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old_logps
    if cfg.importance_sampling_level == "sequence":  # GSPO: the length-normalized sequence log-ratio
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return surrogate(logps, log_ratio, ref_logps, adv, cfg)


def surrogate(
    logps: torch.Tensor, log_ratio: torch.Tensor, ref_logps: torch.Tensor | None, adv: torch.Tensor, cfg
) -> PolicyTerms:
    """The per-token loss from the log-ratio to the old policy (already the sequence's at sequence level), in any
    layout that broadcasts: (B, T) tensors here, a micro-batch's flat completion targets in GRPOObjective."""
    coef_1 = torch.exp(log_ratio)
    kl = None
    if cfg.beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=cfg.eps_high).detach() * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.eps_high)
        coef_1c = torch.clamp(coef_1, max=cfg.delta) if cfg.delta is not None else coef_1
        per_token = -torch.min(coef_1c * adv, coef_2 * adv)
    if kl is not None:
        per_token = per_token + cfg.beta * kl
    return PolicyTerms(per_token, coef_1, kl)


def clip_flags(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low, high, region) bool flags of TRL's clip ratios (cispo: no low; high = region = its cap reached)."""
    if cfg.loss_type == "cispo":
        high = (ratio > cfg.eps_high) & (adv > 0)
        return torch.zeros_like(high), high, high
    low = (ratio < 1 - cfg.epsilon) & (adv < 0)
    high = (ratio > 1 + cfg.eps_high) & (adv > 0)
    return low, high, low | high


def aggregate(
    per_token_loss: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss sum, units) of this micro-batch (see the module docstring); the step's loss is their global ratio."""
    masked = per_token_loss * mask
    rows = torch.tensor(float(mask.size(0)), device=mask.device)
    if cfg.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    if cfg.loss_type == "dr_grpo":
        return masked.sum(), rows * cfg.max_completion_length
    return masked.sum(), mask.sum().to(masked.dtype)


def clip_stats(
    terms: PolicyTerms, advantages: torch.Tensor, mask: torch.Tensor, cfg: PolicyLossConfig
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clip indicators as (sum, count) over completion tokens (one per sequence at sequence level), for TRL's
    clip_ratio/low_mean, high_mean, region_mean (cispo: cispo_clip_ratio), reduced globally by the caller."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = terms.ratio
    weight = mask if ratio.size(1) == mask.size(1) else torch.ones_like(ratio)

    def share(flag: torch.Tensor):
        return (flag.to(mask.dtype) * weight).sum(), weight.sum()

    low, high, region = clip_flags(ratio, adv, cfg)
    if cfg.loss_type == "cispo":
        return {"cispo_clip_ratio": share(region)}
    return {
        "clip_ratio/low_mean": share(low),
        "clip_ratio/high_mean": share(high),
        "clip_ratio/region_mean": share(region),
    }
