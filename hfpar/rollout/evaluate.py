"""GRPO's evaluation (TRL 1.16 GRPOTrainer's in eval mode): `num_generations_eval` completions of each eval prompt,
generated under the training layout as the rollout's are, scored by the same reward functions -> TRL's metrics with
an `eval_` prefix (eval_reward, eval_reward_std, eval_rewards/<name>/mean, eval_completions/mean_length, ...).

    fields = evaluate_prompts(rollout, backend, batches, prompts)     # collective; the same on every rank

Completions are a function of (seed, prompt, generation index) and the weights only: every evaluation of a run draws
the same noise (the step in the row's key is EVAL_STEP), so evaluations differ by the policy alone, and any mesh
evaluates what one process does. Padding slots (None: every rank makes the same number of generate calls) generate
for prompt 0 and are dropped before scoring. No eval loss: the policy loss at ratio 1 on fresh completions is the
advantage-weighted mean, about 0 by construction of the advantage, and tells nothing about the policy.
"""

from __future__ import annotations

import torch

from hfpar.rollout import advantages as A
from hfpar.rollout.engine import truncated
from hfpar.rollout.metrics import window_metrics
from hfpar.rollout.reward_log import RewardLog
from hfpar.rollout.sampling import row_key

EVAL_STEP = -1  # the step of an eval row's sampling key (training windows are >= 0)


def evaluate_prompts(rollout, backend, batches: list[list[int | None]], prompts) -> dict:
    g = rollout.cfg.eval_generations
    rollout.device = backend.acc.device
    n = max((i for idx in batches for i in idx if i is not None), default=-1) + 1
    n = int(_max_over_ranks(n, rollout.device))  # every rank's table covers the whole eval set
    eos, pad = rollout.engine.config.eos_ids, rollout.engine.config.pad_token_id
    flat, per_func, completions, ended = [], [], [], []
    done = rollout.step + 1 if rollout.window is not None else 0  # optimizer steps trained (trainer_state)
    rollout.reward_log = RewardLog()
    for idx in batches:
        rows = [(i, j) for i in idx for j in range(g)]
        items = [prompts[i if i is not None else 0] for i, _ in rows]
        keys = [row_key(rollout.cfg.seed, EVAL_STEP, i if i is not None else 0, j) for i, j in rows]
        out = rollout.engine.generate(backend, [it["prompt_ids"] for it in items], keys)
        keep = [k for k, (i, _) in enumerate(rows) if i is not None]
        if not keep:
            continue
        comps = [out[k] for k in keep]
        where = [rows[k][0] * g + rows[k][1] for k in keep]
        per_func.append(rollout._score([items[k] for k in keep], comps, done, where))
        flat += where
        completions += comps
        ended += [not truncated(c, eos, pad) for c in comps]
    f = len(rollout.rewards)
    scores = torch.cat(per_func) if per_func else torch.zeros((0, f), dtype=torch.float32)
    table = rollout._gather(flat, scores, completions, ended, n * g)
    rewards = A.weighted_rewards(table["rewards"], torch.tensor(rollout.weights, dtype=torch.float64))
    if g > 1:
        _, stats = A.group_advantages(rewards, g, "group")
    else:
        stats = {"std_is_zero": torch.ones_like(rewards, dtype=torch.bool)}
    names = [rf.name for rf in rollout.rewards]
    fields = window_metrics(table, rewards, stats, names, eos, pad)
    fields.update(rollout.reward_log.metrics(rollout.device))  # the reward functions' log_metric (TRL: eval_<name>)
    rollout.reward_log = RewardLog()  # log_extra: eval completions are not written (completions.jsonl is training's)
    return {f"eval_{k}": v for k, v in fields.items()}


def _max_over_ranks(value: int, device) -> int:
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())
