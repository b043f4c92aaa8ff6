"""The DPO objective: TRL 1.16 DPOTrainer's losses, an Objective of hfpar's one training loop.

    objective = DPOObjective(model, ctx, reference=FrozenReference(), beta=0.1, loss_type="sigmoid")  # or [(type, w),
    ..]
    objective.before_micro(backend, batch, replan)  # the reference log-probs of the batch's pairs (or precomputed)
    loss_sum, n_pairs = objective(logits, shifted_labels)

Rows hold one pair each, or several with a shared prompt (hfpar.data.preference.PairCollator: `pairs` in the
batch), and labels carry each completion target's pair (index, side); so the log-probability of a sequence is a sum of
per-token log-probs wherever the tokens are: padded,
cut into context-parallel shards (partial sums all-reduced over the cp group, differentiably), or in a pipeline's
micro-batch (rows stay whole). Under TP the per-token log-probs come from the vocab-parallel logit shards
(vocab_parallel_cross_entropy, reduction none): the full logits are never gathered.

Normalization (the parity contract for preference losses): the loss of an optimizer step is the mean over the
pairs of the whole global batch. The loss function returns the SUM of per-pair losses and the number of pairs,
which the trainer normalizes by the global pair count (count()); a cp rank reports 1/cp of both (every cp rank of
a replica holds the whole pair loss), so sums over ranks count each pair once.

Reference log-probs (before the policy forward of each micro-batch), from the reference component the objective
owns (hfpar.objectives.reference): none (--reference_free: zeros); precomputed once before training (`ref_logps` in
the batch); with LoRA, the policy with its adapters disabled; else a frozen copy of this rank's parameter shards,
swapped in for a no-grad forward through the same backend (so it is sharded exactly as the policy: TP / EP / PP /
FSDP2 shards alike, no grads, no optimizer state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hfpar.data.preference import with_attention_mask
from hfpar.distributed import all_reduce_sum
from hfpar.objectives.base import Batches, Objective
from hfpar.objectives.reference import Reference
from hfpar.objectives.targets import Targets, TargetsHead
from hfpar.parallel.comm import copy_to_parallel_region, reduce_from_parallel_region

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "apo_zero", "sppo_hard")

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def loss_terms(loss_type: str, loss_weights: str | None) -> list[tuple[str, float]] | None:
    """[(loss type, weight), ...] of --loss_type / --loss_weights (TRL's multi-loss: the weighted sum of the per-pair
    losses, e.g. MPO); None where the weights are not one number per type."""
    types = loss_type.split(",")
    try:
        weights = [float(w) for w in loss_weights.split(",")] if loss_weights is not None else [1.0] * len(types)
    except ValueError:
        return None
    return list(zip(types, weights)) if len(weights) == len(types) else None


def pair_losses(
    loss_type: str, beta: float, label_smoothing: float, logps: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Per-pair losses, TRL 1.16's formulas (reverse-KL f-divergence). logps, ref, lengths: (P, 2) chosen, rejected
    (lengths: completion tokens, for ipo's per-token average)."""
    ratios = logps - ref  # (P, 2) log pi / pi_ref
    chosen, rejected = ratios.unbind(-1)
    delta = chosen - rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        avg = ratios / lengths.clamp(min=1.0)
        return (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(beta * chosen)) + torch.sigmoid(beta * rejected)
    if loss_type == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    raise ValueError(f"--loss_type {loss_type!r}: valid values are {', '.join(LOSS_TYPES)}")


def num_pairs(batch: dict, pop: bool = False) -> int:
    """Pairs of a batch: one per row, or `pairs` (P,) rows of pairs packed together (taken out of the batch with
    pop: no model input)."""
    pairs = batch.pop("pairs", None) if pop else batch.get("pairs")
    return pairs.shape[0] if pairs is not None else batch["input_ids"].shape[0]


class DPOObjective(TargetsHead, Objective):
    def __init__(
        self,
        model,
        ctx,
        *,
        reference: Reference | None,
        beta: float = 0.1,
        loss_type: str | list = "sigmoid",
        label_smoothing: float = 0.0,
    ):
        """reference: the reference component (hfpar.objectives.reference; None: reference-free, log-probs 0)."""
        self.ctx, self.beta, self.label_smoothing = ctx, beta, label_smoothing
        # [(loss type, weight), ...]: the per-pair loss is their weighted sum (TRL's multi-loss)
        self.terms = [(loss_type, 1.0)] if isinstance(loss_type, str) else list(loss_type)
        self.reference = reference
        self.reference_free = reference is None
        self.cp = ctx.cp
        self.ref = None  # (P, 2) reference log-probs of the current batch's pairs
        self.rows = 0  # pairs of the current batch
        self._capture = None  # (P, 2) being filled by a reference forward
        self.init_targets_head(model, ctx)
        self.reset_metrics()

    # ------------------------------------------------------------------ per-sequence log-probs
    def sequence_logps(self, out: torch.Tensor, labels: torch.Tensor, rows: int):
        """(rows, 2) summed completion log-probs (differentiable) and (rows, 2) completion lengths, whole over cp."""
        lp, t, _ = self.target_logps(out, labels)
        sums = torch.zeros(2 * rows, dtype=lp.dtype, device=lp.device).index_add(0, t.seq, lp)
        counts = torch.zeros(2 * rows, dtype=lp.dtype, device=lp.device).index_add(0, t.seq, torch.ones_like(lp))
        if self.cp > 1:  # each cp rank holds part of every sequence: all-reduce, forward and backward
            group = self.ctx.cp_group
            sums = reduce_from_parallel_region(copy_to_parallel_region(sums, group), group)
            counts = reduce_from_parallel_region(counts, group)
        return sums.view(rows, 2), counts.view(rows, 2)

    # ------------------------------------------------------------------ the loss function
    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lengths = self.sequence_logps(out, labels, self.rows)
        # the rows this call holds (a pipeline micro-batch holds some of the batch's): every sequence has targets.
        # Masks, not boolean indexing (a host sync each): the other rows count as zeros
        mine = (lengths[:, 0] > 0).unsqueeze(1)
        if self._capture is not None:  # a reference forward: keep the values, no loss
            self._capture = torch.where(mine, logps.detach().double(), self._capture)
            zero = logps.sum() * 0
            return zero, zero
        ref = torch.where(mine, self.ref, 0).to(logps.dtype) if not self.reference_free else torch.zeros_like(logps)
        losses = sum(w * pair_losses(t, self.beta, self.label_smoothing, logps, ref, lengths) for t, w in self.terms)
        losses = torch.where(mine[:, 0], losses, 0)
        self._record(logps.detach().double(), ref.double(), mine)
        n = mine.sum(dtype=torch.float64) / self.cp
        return losses.sum() / self.cp, n

    # ------------------------------------------------------------------ the reference, before training
    def bind(self, model) -> None:
        if self.reference is not None:
            self.reference.bind(model)

    def prepare(self, backend, train_batches: Batches, eval_batches: Batches) -> None:
        """A precomputed reference: its log-probs of every pair of the run, before training and before resume (the
        model is the initial one: the reference)."""
        if self.reference is not None and self.reference.precomputed:
            self.reference.precompute(
                lambda batch, scope: self.reference_logps(backend, batch, scope), train_batches, eval_batches
            )

    def sample(self, split: str, index: int, sample: dict) -> dict:
        """A pair with its precomputed reference log-probs (ref_chosen_logps, ref_rejected_logps), if any."""
        return self.reference.sample(split, index, sample) if self.reference is not None else sample

    def padding_sample(self, sample: dict) -> dict:
        """An eval padding slot: the pair collator gives it no targets."""
        sample["no_targets"] = True
        return sample

    # ------------------------------------------------------------------ counts and metrics
    def count(self, batch: dict) -> float:
        """Pairs of a (planned) micro-batch, as the trainer sums them over ranks (1/cp per cp rank)."""
        return num_pairs(batch) / self.cp

    @staticmethod
    def tokens(sample: dict) -> int:
        """Real tokens of a pair's row (tokens/s)."""
        return 2 * len(sample["prompt_ids"]) + len(sample["chosen_ids"]) + len(sample["rejected_ids"])

    def reset_metrics(self) -> None:
        self._sums = None  # (len(METRICS) + 1,) float64 on the device once a pair is recorded

    def _record(self, logps: torch.Tensor, ref: torch.Tensor, mine: torch.Tensor) -> None:
        """Adds the pairs' metric sums on the device (no host sync: read once per step, step_sums)."""
        r = torch.where(mine, self.beta * (logps - ref), 0)  # (P, 2) implicit rewards
        logps = torch.where(mine, logps, 0)
        won = (r[:, 0] > r[:, 1]) & mine[:, 0]
        s = torch.stack(
            [
                r[:, 0].sum(),
                r[:, 1].sum(),
                won.double().sum(),
                (r[:, 0] - r[:, 1]).sum(),
                logps[:, 0].sum(),
                logps[:, 1].sum(),
                mine.sum(dtype=torch.float64),
            ]
        )
        self._sums = s if self._sums is None else self._sums + s

    def step_sums(self, device) -> torch.Tensor:
        """This rank's metric sums of the step (the trainer all-reduces them with its loss: one collective, one
        host sync a step), then reset."""
        s = self._sums if self._sums is not None else torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device)
        self.reset_metrics()
        return s

    @staticmethod
    def metrics(sums: list[float]) -> dict:
        """TRL's metric names from reduced sums (step_sums over the ranks): means over the pairs of the global batch.
        Ranks holding the same pairs (tp, cp) count them alike, so the ratio is unaffected."""
        n = sums[-1]
        return {k: sums[i] / n for i, k in enumerate(METRICS)} if n else {}

    def _step_metrics(self, device) -> dict:
        """The metrics of the sums so far (collective: every rank calls it), then reset."""
        return self.metrics(all_reduce_sum(self.step_sums(device), device).tolist())

    def begin_eval(self) -> None:
        """Evaluation: its metrics apart from the training step's (an eval may run between two steps' micro-batches
        only at a step's end, but the sums are kept anyway)."""
        self._train_sums = self._sums
        self.reset_metrics()

    def end_eval(self, device) -> dict:
        """The eval's metrics with TRL's names (eval_rewards/chosen, ...; collective), the training sums restored."""
        out = {f"eval_{k}": v for k, v in self._step_metrics(device).items()}
        self._sums = self._train_sums
        return out

    # ------------------------------------------------------------------ the reference
    def before_micro(self, backend, batch: dict, replan) -> None:
        """Before the policy's forward of a micro-batch: its attention mask (shared-prompt rows: built on the
        device from the batch's pair_layout), its completion targets (Targets, found once for both forwards) and
        its pairs' reference log-probs (replan() -> the batch and a fresh scope, for the reference's forward)."""
        ref = batch.pop("ref_logps", None)
        self.rows = num_pairs(batch, pop=True)
        with_attention_mask(batch)
        self._plan = Targets(batch["labels"])
        if self.reference is None:
            self.ref = None
            return
        if ref is not None:
            self.ref = ref.to(batch["input_ids"].device)
            return
        ref_batch, scope = replan()
        # the same rows planned again: the same labels, so the same targets and mask (not computed twice)
        ref_batch.pop("pair_layout", None)
        ref_batch = {
            **ref_batch,
            "labels": batch["labels"],
            **({"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}),
        }
        self.ref = self.reference_logps(backend, ref_batch, scope)

    @torch.no_grad()
    def reference_logps(self, backend, batch: dict, scope) -> torch.Tensor:
        """(B, 2) of the reference: a no-grad forward through the backend (the pipeline's included) with the
        reference in place of the policy."""
        batch.pop("ref_logps", None)
        self.rows = num_pairs(batch, pop=True)
        with_attention_mask(batch)
        if self._plan is None or not self._plan.matches(batch["labels"]):  # called alone (precompute_reference)
            self._plan = Targets(batch["labels"])
        self._capture = torch.zeros(self.rows, 2, dtype=torch.float64, device=batch["input_ids"].device)
        self.ref = None
        try:
            with self.reference(backend):
                backend.eval_loss(batch, scope, self, "lm")
            return self._capture
        finally:
            self._capture = None
