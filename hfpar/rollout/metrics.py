"""The metrics of a generation batch, TRL 1.16 GRPOTrainer's names and formulas, from the whole batch's table
(hfpar.rollout.loop: the same on every rank).

    fields = window_metrics(table, rewards, stats, ["exact_match"], eos_token_id=[2], pad_token_id=0)
"""

from __future__ import annotations

import torch

from hfpar.rollout.advantages import nanstd
from hfpar.rollout.sampling import eos_list


def window_metrics(
    table: dict, rewards: torch.Tensor, stats: dict, names: list[str], eos_token_id, pad_token_id
) -> dict:
    """completions/* (lengths; clipped: the last token neither an EOS id (an id or TRL's list) nor padding, TRL's
    rule), rewards/<name>/mean and std, reward, reward_std, frac_reward_zero_std."""
    lengths = table["lengths"]
    ids = table["ids"]
    last = ids[torch.arange(ids.size(0)), (lengths.long() - 1).clamp(min=0)]
    eos = torch.tensor(eos_list(eos_token_id), dtype=torch.long)
    truncated = ~torch.isin(last, eos) & (last != pad_token_id)
    term = lengths[~truncated]
    if term.numel() == 0:
        term = torch.zeros(1, dtype=lengths.dtype)
    out = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.double().mean()),
        "completions/mean_terminated_length": float(term.mean()),
        "completions/min_terminated_length": float(term.min()),
        "completions/max_terminated_length": float(term.max()),
    }
    per_func = table["rewards"]
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(torch.nanmean(per_func[:, j]))
        out[f"rewards/{name}/std"] = float(nanstd(per_func[:, j]))
    out["reward"] = float(torch.nanmean(rewards))
    out["reward_std"] = float(nanstd(rewards))
    out["frac_reward_zero_std"] = float(stats["std_is_zero"].double().mean())
    return out
