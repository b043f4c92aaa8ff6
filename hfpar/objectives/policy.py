"""The GRPO objective: TRL 1.16 GRPOTrainer's policy loss (grpo, dr_grpo, dapo, bnpo, cispo; token or sequence
importance sampling; k3 KL to a reference), an Objective of hfpar's one training loop.

    objective = GRPOObjective(model, ctx, cfg=PolicyLossConfig(...), reference=FrozenReference() | None,
                              rollout=Rollout(...))
    samples = objective.step_samples(backend, step, micro, dataset)  # the rollout: generated at a window's start
    objective.before_micro(backend, batch, replan)                  # the batch's advantages and per-token values
    loss_sum, units = objective(logits, shifted_labels)

Every value is per completion target, found from the labels (hfpar.rollout.collate: each target carries its row), so
the same code holds for padded rows, context-parallel cuts (per-row sums all-reduced over the cp group,
differentiably) and a vocab-parallel head. Where the recipe's chunked head is installed (--loss_chunk_size unset or
> 0; hfpar.parallel.chunked_loss) it computes the completion targets' log-probs and entropies chunk by chunk
(hfpar.parallel.chunked_logps), so no (targets, vocab) logits exist at once; with --loss_chunk_size 0 the head forms
the targets' logits (1, N, V) (under TP: the vocab shard's logits of every position). The
units (count) follow hfpar.rollout.policy_loss.aggregate: tokens (dapo, bnpo, cispo), rows (grpo), rows x
max_completion_length (dr_grpo), over the whole global batch. Metrics are global ratios (TRL's names): kl, entropy,
clip_ratio/*.
"""

from __future__ import annotations

import contextlib

import torch

from hfpar.objectives.base import Objective
from hfpar.objectives.preference import Targets, _token_logps
from hfpar.objectives.reference import Reference
from hfpar.parallel.chunked_loss import chunked_loss_state
from hfpar.parallel.comm import copy_to_parallel_region, reduce_from_parallel_region
from hfpar.parallel.labels import IGNORE
from hfpar.parallel.sharding import shard_spec
from hfpar.rollout.collate import SIDE
from hfpar.rollout.entropy import token_entropy
from hfpar.rollout.policy_loss import PolicyLossConfig

POP = (*SIDE, "advantages", "columns")
# step sums: kl, entropy, clip low, high, region (or cispo's), token weight, clip weight
_KL, _ENT, _LOW, _HIGH, _REGION, _TOK, _CLIPW = range(7)


class GRPOObjective(Objective):
    def __init__(self, model, ctx, *, cfg: PolicyLossConfig, reference: Reference | None, rollout):
        self.ctx, self.cfg, self.reference, self.rollout = ctx, cfg, reference, rollout
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        spec = shard_spec(head.weight) if head is not None else None
        self.tp_group = spec.group if spec is not None and spec.kind == "tp" and spec.sharded else None
        self.cp = ctx.cp
        self._side: dict = {}  # the current micro-batch's advantages / per-token values (before_micro)
        self._plan = None  # its Targets
        self._capture = None  # (B, T) being filled by a no-grad forward (capture_logps)
        self._sums = None
        self.scope = None
        self._targets = None
        self._head_values = False  # the last forward's head returned chunked token values
        # the recipe's chunked head (hfpar.parallel.chunked_loss, --loss_chunk_size): it returns the targets'
        # log-probs and entropies, chunked (hfpar.parallel.chunked_logps; vocab-parallel heads too)
        self.chunked = chunked_loss_state(model) if ctx.pp == 1 else None
        if head is not None and (self.tp_group is None or self.chunked is not None) and ctx.pp == 1:
            head.register_forward_pre_hook(self._head_rows)
            self.scope = self.select_targets

    # ------------------------------------------------------------------ the LM head on the targets only
    @contextlib.contextmanager
    def select_targets(self, labels: torch.Tensor):
        """Within: the LM head computes the completion targets only: their logits (1, N, V) (as DPO's), or with the
        chunked head their log-probs and entropies (1, N, 2), never the (N, V) logits at once."""
        self._targets = self.targets(labels)
        values = self.chunked.token_values(self._targets.token) if self.chunked else contextlib.nullcontext()
        made = self.chunked.values_made if self.chunked else 0
        try:
            with values:
                yield
        finally:
            self._targets = None
            # whether this forward's output is the chunked head's values (a reference model of its own, ZeRO-3's,
            # has another head: its forward returns the full logits)
            self._head_values = self.chunked is not None and self.chunked.values_made > made

    def _head_rows(self, module, args):
        x = args[0] if args else None
        if self._targets is None or x is None or x.shape[:-1] != self._targets.shape:
            return None
        return (x.reshape(-1, x.shape[-1]).index_select(0, self._targets.index).unsqueeze(0), *args[1:])

    def targets(self, labels: torch.Tensor) -> Targets:
        return self._plan if self._plan is not None and self._plan.matches(labels) else Targets(labels)

    def _token_values(self, out: torch.Tensor, labels: torch.Tensor, entropy: bool):
        """(N,) log-probs of the targets (differentiable), their rows, their flat positions in the micro-batch's
        (B, T) tensors (a pipeline's loss gets a slice of its rows: each target's row is in its label), and (N,)
        entropies or None."""
        t = self.targets(labels)
        rows = t.seq // 2
        whole = rows * labels.shape[1] + t.index % labels.shape[1]
        if self._head_values:  # the chunked head's (1, N, 2): log-prob, entropy (select_targets)
            lp, ent = out.reshape(-1, 2).unbind(-1)
            return lp, rows, whole, ent.detach() if entropy else None
        if out.shape[:-1] == labels.shape:  # full logits (or their vocab shard): the targets' positions
            token = torch.full_like(labels, IGNORE).reshape(-1).index_copy(0, t.index, t.token).view(labels.shape)
            lp = _token_logps(out, token, self.tp_group).reshape(-1).index_select(0, t.index)
            flat = out.reshape(-1, out.shape[-1]).index_select(0, t.index) if entropy else None
        else:  # the head computed the targets' logits only (select_targets)
            flat = out.reshape(-1, out.shape[-1])
            lp = _token_logps(flat, t.token, None)
        ent = token_entropy(flat, self.tp_group) if entropy else None
        return lp, rows, whole, ent

    def _row_sum(self, values: torch.Tensor, rows: torch.Tensor, n: int, grad: bool) -> torch.Tensor:
        """(n,) per-row sums of per-target values, whole over the cp group (differentiable where grad)."""
        s = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, rows, values)
        if self.cp > 1:
            group = self.ctx.cp_group
            s = reduce_from_parallel_region(copy_to_parallel_region(s, group), group) if grad else _all_reduce(s, group)
        return s

    # ------------------------------------------------------------------ the loss
    def __call__(self, out: torch.Tensor, labels: torch.Tensor):
        if self._capture is not None:  # a no-grad forward for old / reference log-probs: keep them, no loss
            lp, _, index, _ = self._token_values(out, labels, entropy=False)
            self._capture.view(-1).index_copy_(0, self._side["columns_flat"][index], lp.detach().float())
            zero = out.sum() * 0
            return zero, zero
        cfg, side = self.cfg, self._side
        lp, rows, index, ent = self._token_values(out, labels, entropy=True)
        n_rows = side["advantages"].numel()
        old = side["old_logps"].reshape(-1)[index] if "old_logps" in side else lp.detach()
        adv = side["advantages"].to(lp.dtype)[rows]
        ones = torch.ones_like(lp)
        length = self._row_sum(ones, rows, n_rows, grad=False)  # completion targets per row, whole
        log_ratio = lp - old
        if cfg.importance_sampling_level == "sequence":  # GSPO: the row's mean log-ratio
            log_ratio = (self._row_sum(log_ratio, rows, n_rows, grad=True) / length.clamp(min=1.0))[rows]
        coef_1 = torch.exp(log_ratio)
        kl = None
        if cfg.beta != 0.0:
            ref = side["ref_logps"].reshape(-1)[index].to(lp.dtype)
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            if cfg.use_bias_correction_kl:
                kl = kl * coef_1
        if cfg.loss_type == "cispo":
            per_token = -torch.clamp(coef_1, max=cfg.eps_high).detach() * adv * lp
        else:
            coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.eps_high)
            coef_1c = torch.clamp(coef_1, max=cfg.delta) if cfg.delta is not None else coef_1
            per_token = -torch.min(coef_1c * adv, coef_2 * adv)
        if kl is not None:
            per_token = per_token + cfg.beta * kl
        if cfg.loss_type == "grpo":  # each row's token mean, summed over rows (units: rows)
            per_token = per_token / length.clamp(min=1.0)[rows]
        self._record(coef_1.detach(), adv, kl, ent, rows, length)
        return per_token.sum(), torch.zeros((), device=lp.device)

    def count(self, batch: dict) -> float:
        """The units of a planned micro-batch (hfpar.rollout.policy_loss.aggregate), as summed over ranks."""
        if self.cfg.loss_type == "grpo":
            return batch["advantages"].numel() / self.cp
        if self.cfg.loss_type == "dr_grpo":
            return batch["advantages"].numel() * self.cfg.max_completion_length / self.cp
        return float((batch["labels"] != IGNORE).sum())

    @staticmethod
    def tokens(sample: dict) -> int:
        return len(sample["prompt_ids"]) + len(sample["completion_ids"])

    # ------------------------------------------------------------------ metrics (TRL's names)
    def _record(self, coef_1, adv, kl, ent, rows, length) -> None:
        cfg = self.cfg
        sequence = cfg.importance_sampling_level == "sequence"
        # a row counts once at sequence level: each of its targets weighs 1 / its length
        w = (1.0 / length.clamp(min=1.0))[rows] if sequence else torch.ones_like(coef_1)
        if cfg.loss_type == "cispo":
            low = torch.zeros_like(coef_1, dtype=torch.bool)
            high = region = (coef_1 > cfg.eps_high) & (adv > 0)
        else:
            low = (coef_1 < 1 - cfg.epsilon) & (adv < 0)
            high = (coef_1 > 1 + cfg.eps_high) & (adv > 0)
            region = low | high
        d = torch.float64
        s = torch.stack(
            [
                kl.detach().sum().to(d) if kl is not None else torch.zeros((), dtype=d, device=coef_1.device),
                ent.sum().to(d),
                (low.to(d) * w).sum(),
                (high.to(d) * w).sum(),
                (region.to(d) * w).sum(),
                torch.tensor(float(coef_1.numel()), dtype=d, device=coef_1.device),
                w.to(d).sum(),
            ]
        )
        self._sums = s if self._sums is None else self._sums + s

    def step_sums(self, device) -> torch.Tensor:
        s = self._sums if self._sums is not None else torch.zeros(7, dtype=torch.float64, device=device)
        self._sums = None
        return s

    def metrics(self, sums) -> dict:
        """Global ratios: the values are per target; ranks holding the same targets (tp) count them alike."""
        tok, clipw = sums[_TOK], sums[_CLIPW]
        if not tok:
            return {}
        out = {"entropy": sums[_ENT] / tok}
        if self.cfg.beta != 0.0:
            out["kl"] = sums[_KL] / tok
        if self.cfg.loss_type == "cispo":
            out["cispo_clip_ratio"] = sums[_REGION] / clipw
        else:
            out["clip_ratio/low_mean"] = sums[_LOW] / clipw
            out["clip_ratio/high_mean"] = sums[_HIGH] / clipw
            out["clip_ratio/region_mean"] = sums[_REGION] / clipw
        return {**out, **self.rollout.step_metrics()}

    # ------------------------------------------------------------------ the step's rows
    def bind(self, model) -> None:
        if self.reference is not None:
            self.reference.bind(model)

    def step_samples(self, backend, step: int, micro, dataset) -> list[list[dict]]:
        """The rollout's rows for this optimizer step (generated, scored and log-probed at a window's start)."""
        return self.rollout.step_samples(backend, step, self)

    def before_micro(self, backend, batch: dict, replan) -> None:
        """Takes the batch's advantages and per-token values out of it (no model inputs) and finds its targets."""
        self._side = {k: batch.pop(k) for k in POP if k in batch}
        self._plan = Targets(batch["labels"])

    @torch.no_grad()
    def capture_logps(self, backend, batch: dict, scope, reference: bool) -> torch.Tensor:
        """(B, T) log-probs of a planned batch's completion targets, at their predicting columns of the full rows
        (0 elsewhere; whole over the cp group): the policy's (old log-probs) or the reference's."""
        self.before_micro(backend, batch, None)
        cols = self._side["columns"]
        n, t = cols.shape[0], cols.shape[1] * self.cp  # the full rows' length (a multiple of the cp cut)
        self._side["columns_flat"] = (cols + torch.arange(n, device=cols.device).unsqueeze(1) * t).reshape(-1)
        self._capture = torch.zeros(n, t, dtype=torch.float32, device=batch["input_ids"].device)
        try:
            with self.reference(backend) if reference else contextlib.nullcontext():
                backend.eval_loss(batch, scope, self, "lm")
            out = self._capture
        finally:
            self._capture = None
        return _all_reduce(out, self.ctx.cp_group) if self.cp > 1 else out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return self.rollout.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollout.load_state_dict(state)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    torch.distributed.all_reduce(t, group=group)
    return t
