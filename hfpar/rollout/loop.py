"""The rollout of a GRPO run: at each generation window's first step, generate the window's completions under the
training layout, score them, compute the advantages over the whole generation batch, and the log-probs the loss
needs; then hand each optimizer step its micro-batches of rows.

    rollout = Rollout(schedule, prompts, tokenizer, engine, rewards, ctx, cfg)
    micro_batches = rollout.step_samples(backend, step, objective)    # collective at a window's first step

Which rows a rank trains on and the prompts of a window come from the RolloutSchedule (mesh-independent); rewards are
scored once per row (by the rank that leads its replica: tp, cp and pp rank 0) and summed over the world into the
whole batch's table, so every rank computes the same advantages (TRL gathers rewards the same way). Old log-probs
(the policy at generation time: needed when a window is trained on more than once) and the reference's are computed
here with no-grad forwards of the same micro-batches the steps will train on.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch

from hfpar.distributed import all_reduce_sum, process_rank
from hfpar.rollout import advantages as A
from hfpar.rollout.collate import RolloutCollator
from hfpar.rollout.engine import truncated
from hfpar.rollout.evaluate import evaluate_prompts
from hfpar.rollout.metrics import window_metrics
from hfpar.rollout.parse import assistant_messages
from hfpar.rollout.reward_log import RewardLog, RunProgress
from hfpar.rollout.rewards import score
from hfpar.rollout.sampling import row_key
from hfpar.train.batch_plan import BatchPlan


@dataclass(frozen=True)
class RolloutConfig:
    advantage: str = "grpo"  # grpo (group-normalized) | rloo (leave-one-out baseline)
    scale_rewards: str = "group"
    normalize_advantages: bool = False  # rloo: standardized over the batch
    mask_truncated_completions: bool = False
    eval_generations: int = 8  # completions per eval prompt (num_generations_eval, default num_generations)
    old_logps: bool = False  # a window trained more than once (num_iterations > 1 or more passes than one step)
    ref_logps: bool = False  # beta != 0
    seed: int = 42
    log_completions: str | None = None  # a path: completions.jsonl (rank 0)
    progress: RunProgress | None = None  # the run's numbers the reward functions' trainer_state carries


class Rollout:
    def __init__(self, schedule, prompts, tokenizer, engine, rewards, weights, ctx, cfg: RolloutConfig, cp_mode):
        self.schedule, self.prompts, self.tokenizer, self.engine = schedule, prompts, tokenizer, engine
        self.rewards, self.weights, self.ctx, self.cfg = rewards, weights, ctx, cfg
        self.device = None  # the backend's, at the first step
        self.reward_models = {}  # RewardFunc name -> RewardModel, loaded on first use
        self.collate = RolloutCollator(tokenizer.pad_token_id or 0, ctx.seq_multiple)
        self.plan = BatchPlan("lm", ctx, cp_mode)
        self.window = None
        self.step = 0  # the last optimizer step's (0-based): an eval's reward functions get it
        self.rows: list[list[dict]] = []  # this rank's rows, per micro-step of a pass
        self._metrics: dict = {}
        self.reward_log = RewardLog()  # what the reward functions log (log_metric, log_extra), until flushed
        self.owner = ctx.tp_rank == 0 and ctx.cp_rank == 0 and ctx.pp_rank == 0

    # ------------------------------------------------------------------ the trainer's side
    def step_samples(self, backend, step: int, objective) -> list[list[dict]]:
        window, k = self.schedule.position(step)
        self.device, self.step = backend.acc.device, step
        if window != self.window:
            self._generate(backend, window, step, objective)
        accum = self.schedule.accum
        return [self.rows[m] for m in range(k * accum, (k + 1) * accum)]

    def step_metrics(self) -> dict:
        """The generation's metrics, on the step that generated (TRL logs them there), then cleared."""
        out, self._metrics = self._metrics, {}
        return out

    # ------------------------------------------------------------------ a window
    def _generate(self, backend, window: int, step: int, objective) -> None:
        sched, cfg = self.schedule, self.cfg
        prompts = sched.prompts(window)
        mine = sched.rank_rows(self.ctx.dp_rank)
        flat = [r for rows in mine for r in rows]
        where = [sched.row(prompts, r) for r in flat]
        items = [self.prompts[p] for p, _ in where]
        keys = [row_key(cfg.seed, window, p, g) for p, g in where]
        t0 = time.perf_counter()
        completions = self.engine.generate(backend, [it["prompt_ids"] for it in items], keys)
        t1 = time.perf_counter()
        eos = self.engine.config.eos_ids  # TRL's list: the checkpoint's EOS ids and the tokenizer's
        pad = self.engine.config.pad_token_id
        ended = [not truncated(c, eos, pad) for c in completions]  # ends in EOS or pad (TRL's rule)
        per_func = self._score(items, completions, step, flat)
        table = self._gather(flat, per_func, completions, ended, sched.generation_batch)
        rewards = A.weighted_rewards(table["rewards"], torch.tensor(self.weights, dtype=torch.float64))
        if cfg.advantage == "rloo":
            adv = A.rloo_advantages(rewards, sched.num_generations, cfg.normalize_advantages)
            stats = {"std": torch.zeros_like(rewards), "std_is_zero": torch.zeros_like(rewards, dtype=torch.bool)}
        else:
            adv, stats = A.group_advantages(rewards, sched.num_generations, cfg.scale_rewards)
        self._metrics = window_metrics(table, rewards, stats, [rf.name for rf in self.rewards], eos, pad)
        self._metrics.update(self.reward_log.metrics(self.device))  # log_metric's: TRL logs them on this step
        extra = self.reward_log.extra() if cfg.log_completions else {}  # log_extra's: completions.jsonl columns
        self.rows = []
        for rows in mine:
            batch = []
            for r in rows:
                i = flat.index(r)
                keep = 0 if (cfg.mask_truncated_completions and not ended[i]) else 1
                batch.append(
                    {
                        "prompt_ids": items[i]["prompt_ids"],
                        "completion_ids": completions[i],
                        "targets": [keep] * len(completions[i]),
                        "advantage": float(adv[r]),
                    }
                )
            self.rows.append(batch)
        self._logps(backend, objective)
        self.window = window
        # this rank's seconds: generation, then scoring + advantages + old / reference log-probs
        self._metrics.update(generation_time_s=t1 - t0, rollout_rest_time_s=time.perf_counter() - t1)
        if cfg.log_completions and process_rank() == 0:
            self._log(step, window, prompts, table, rewards, adv, extra)
        self.reward_log = RewardLog()  # what was not flushed (log_extra without --log_completions) goes

    def _score(self, items, completions, global_step: int, rows: list[int]) -> torch.Tensor:
        """(n, F) rewards of this rank's rows (NaN: None; `rows`: their numbers in the batch), scored by a
        replica's leading rank only; global_step: the optimizer steps done (the reward functions' trainer_state)."""
        n = len(completions)
        if not self.owner:
            return torch.zeros((n, len(self.rewards)), dtype=torch.float32)
        prompts = [it["prompt"] for it in items]
        if isinstance(prompts[0], list):  # conversational: TRL's messages (the tokenizer's response parser, if any)
            comps = assistant_messages(self.tokenizer, completions, [it["prompt_ids"] for it in items])
        else:
            comps = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        columns = {k: [it[k] for it in items] for k in items[0] if k not in ("prompt", "prompt_ids")}
        progress = self.cfg.progress or RunProgress(max_steps=0, steps_per_epoch=1)
        state = progress.state(global_step)
        out = score(self.rewards, prompts, comps, completions, columns, global_step + 1, state, self.reward_log)
        self.reward_log.scored(rows)
        for j, rf in enumerate(self.rewards):
            if rf.func is None:  # a reward model directory
                out[:, j] = torch.tensor(self._reward_model(rf)(prompts, comps), dtype=torch.float32)
        return out

    def _reward_model(self, rf):
        from hfpar.rollout.reward_model import RewardModel  # noqa: PLC0415  (runs with a reward model only)

        if rf.name not in self.reward_models:
            self.reward_models[rf.name] = RewardModel(rf.model_dir, self.device)
        return self.reward_models[rf.name]

    def _gather(self, flat, per_func, completions, ended, n: int) -> dict:
        """The whole batch's table of n rows (`flat`: this rank's row numbers), the same on every rank: rewards (n, F)
        (NaN: None), completion lengths, ended-with-EOS flags and ids (n, max_new_tokens, -1 padded): each row
        written by its replica's leading rank, summed over the world (exact: one writer per row)."""
        f = len(self.rewards)
        c = self.engine.config.max_new_tokens
        rewards = torch.zeros((n, f), dtype=torch.float64)
        none = torch.zeros((n, f), dtype=torch.float64)
        lengths = torch.zeros(n, dtype=torch.float64)
        done = torch.zeros(n, dtype=torch.float64)
        ids = torch.zeros((n, c), dtype=torch.float64)
        if self.owner:
            for i, r in enumerate(flat):
                v = per_func[i].double()
                none[r] = torch.isnan(v).double()
                rewards[r] = torch.nan_to_num(v, nan=0.0)
                lengths[r] = len(completions[i])
                done[r] = float(ended[i])
                ids[r, : len(completions[i])] = torch.tensor(completions[i], dtype=torch.float64) + 1
        packed = torch.cat([rewards.view(-1), none.view(-1), lengths, done, ids.view(-1)])
        packed = all_reduce_sum(packed.to(self.device), self.device).cpu()
        rewards, rest = packed[: n * f].view(n, f), packed[n * f :]
        none, rest = rest[: n * f].view(n, f), rest[n * f :]
        rewards[none > 0] = math.nan
        return {
            "rewards": rewards,
            "lengths": rest[:n],
            "ended": rest[n : 2 * n] > 0,
            "ids": rest[2 * n :].view(n, c).long() - 1,
        }

    def _logps(self, backend, objective) -> None:
        """Old and reference log-probs of every row of the window (no-grad forwards of the step's micro-batches)."""
        wanted = [("old_logps", False)] if self.cfg.old_logps else []
        wanted += [("ref_logps", True)] if self.cfg.ref_logps else []
        for rows in self.rows:
            for key, ref in wanted:
                batch, scope = self.plan({k: v.to(self.device) for k, v in self.collate(rows).items()})
                values = objective.capture_logps(backend, batch, scope, reference=ref).cpu()
                for r, row in enumerate(rows):
                    p, n = len(row["prompt_ids"]), len(row["completion_ids"])
                    row[key] = values[r, p - 1 : p + n - 1].tolist()

    def _log(self, step, window, prompts, table, rewards, adv, extra: dict) -> None:
        with open(self.cfg.log_completions, "a") as fh:
            for r in range(self.schedule.generation_batch):
                p, g = self.schedule.row(prompts, r)
                n = int(table["lengths"][r])
                fh.write(
                    json.dumps(
                        {
                            "step": step + 1,
                            "window": window,
                            "row": r,
                            "prompt_index": p,
                            "generation": g,
                            "prompt_ids": list(self.prompts[p]["prompt_ids"]),
                            "completion_ids": table["ids"][r, :n].tolist(),
                            "reward": None if math.isnan(float(rewards[r])) else float(rewards[r]),
                            "advantage": float(adv[r]),
                            **{k: v.get(r) for k, v in extra.items()},  # the reward functions' log_extra columns
                        }
                    )
                    + "\n"
                )

    def evaluate(self, backend, batches: list[list[int | None]], prompts) -> dict:
        """Collective: a group of completions for each eval prompt, scored -> TRL's eval_* metrics."""
        return evaluate_prompts(self, backend, batches, prompts)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The current window's rows, whole (collective): resume inside a window trains on the same rows, with the
        same old and reference log-probs, on any mesh."""
        if self.window is None:
            return {}
        n, c = self.schedule.generation_batch, self.engine.config.max_new_tokens
        mine = self.schedule.rank_rows(self.ctx.dp_rank)
        t = {k: torch.zeros((n, c), dtype=torch.float64) for k in ("ids", "targets", "old_logps", "ref_logps")}
        adv, lengths = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        # the log-probs from the pipeline's last stage (where the loss, hence the capture, runs), the rest from the
        # replica's leading rank: one writer per value
        logp_owner = self.ctx.tp_rank == 0 and self.ctx.cp_rank == 0 and self.ctx.pp_rank == self.ctx.pp - 1
        for rows, batch in zip(mine, self.rows):
            for r, row in zip(rows, batch):
                m = len(row["completion_ids"])
                if self.owner:
                    lengths[r], adv[r] = m, row["advantage"]
                    t["ids"][r, :m] = torch.tensor(row["completion_ids"], dtype=torch.float64)
                    t["targets"][r, :m] = torch.tensor(row["targets"], dtype=torch.float64)
                for k in ("old_logps", "ref_logps"):
                    if logp_owner and row.get(k) is not None:
                        t[k][r, :m] = torch.tensor(row[k], dtype=torch.float64)
        keys = list(t)
        packed = torch.cat([*(t[k].view(-1) for k in keys), adv, lengths]).to(self.device)
        packed = all_reduce_sum(packed, self.device).cpu()
        out = {k: packed[i * n * c : (i + 1) * n * c].view(n, c) for i, k in enumerate(keys)}
        out["advantages"], out["lengths"] = packed[len(keys) * n * c : -n], packed[-n:]
        out["window"] = torch.tensor([self.window], dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict) -> None:
        if "window" not in state:
            return
        self.window = int(state["window"][0])
        prompts = self.schedule.prompts(self.window)
        self.rows = []
        for rows in self.schedule.rank_rows(self.ctx.dp_rank):
            batch = []
            for r in rows:
                m = int(state["lengths"][r])
                row = {
                    "prompt_ids": self.prompts[self.schedule.row(prompts, r)[0]]["prompt_ids"],
                    "completion_ids": state["ids"][r, :m].long().tolist(),
                    "targets": state["targets"][r, :m].long().tolist(),
                    "advantage": float(state["advantages"][r]),
                }
                if self.cfg.old_logps:
                    row["old_logps"] = state["old_logps"][r, :m].float().tolist()
                if self.cfg.ref_logps:
                    row["ref_logps"] = state["ref_logps"][r, :m].float().tolist()
                batch.append(row)
            self.rows.append(batch)
