"""GRPOObjective (per completion target, found from the labels; the LM head on the targets only) computes the loss
and gradient of hfpar.rollout.policy_loss's (B, T) formulas (checked against TRL 1.16 in test_rollout_math.py), for
every loss type, token and sequence importance sampling, with and without the KL term; and its old / reference
log-probs capture puts each value at its predicting column."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.objectives.policy import GRPOObjective
from hfpar.rollout.collate import RolloutCollator
from hfpar.rollout.policy_loss import LOSS_TYPES, PolicyLossConfig, aggregate, policy_terms
from hfpar.train.batch_plan import BatchPlan
from tests.helpers.tiny_configs import TINY

CTX = SimpleNamespace(cp=1, pp=1, tp=1, cp_group=None)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).float()


def _rows(n: int = 6, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        p, c = rng.randint(2, 6), rng.randint(1, 7)
        rows.append(
            {
                "prompt_ids": [rng.randint(3, 63) for _ in range(p)],
                "completion_ids": [rng.randint(3, 63) for _ in range(c)],
                "targets": [1] * c if rng.random() < 0.8 else [0] * c,
                "advantage": rng.uniform(-1.5, 1.5),
                "old_logps": [rng.uniform(-5.0, -3.0) for _ in range(c)],
                "ref_logps": [rng.uniform(-5.0, -3.0) for _ in range(c)],
            }
        )
    return rows


def _reference(model, rows, cfg) -> torch.Tensor:
    """policy_terms + aggregate on the (B, C) completion layout, from full logits of one row at a time."""
    b, c = len(rows), max(len(r["completion_ids"]) for r in rows)
    logps = torch.zeros(b, c)
    mask = torch.zeros(b, c)
    old, ref = torch.zeros(b, c), torch.zeros(b, c)
    for i, r in enumerate(rows):
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p, n = len(r["prompt_ids"]), len(r["completion_ids"])
        tok = torch.tensor(r["completion_ids"])
        logps[i, :n] = lp[p - 1 : p + n - 1].gather(1, tok[:, None])[:, 0]
        mask[i, :n] = torch.tensor(r["targets"], dtype=torch.float32)
        old[i, :n], ref[i, :n] = torch.tensor(r["old_logps"]), torch.tensor(r["ref_logps"])
    adv = torch.tensor([r["advantage"] for r in rows])
    terms = policy_terms(logps, old, ref, adv, mask, cfg)
    s, units = aggregate(terms.per_token_loss, mask, cfg)
    return s / units


def _ours(model, rows, cfg, select: bool) -> torch.Tensor:
    obj = GRPOObjective(model, CTX, cfg=cfg, reference=None, rollout=None)
    if not select:
        obj.scope = None
    batch, scope = BatchPlan("lm", CTX)(RolloutCollator(pad_id=0)(rows))
    units = obj.count(batch)
    obj.before_micro(None, batch, None)
    labels = batch.pop("labels")
    with scope, obj.scope(labels) if obj.scope else torch.enable_grad():
        out = model(**batch).logits
    s, _ = obj(out, labels)
    return s / units


CASES = [
    (lt, level, beta)
    for lt in LOSS_TYPES
    for level, beta in (("token", 0.0), ("token", 0.05), ("sequence", 0.0), ("sequence", 0.05))
    if not (lt == "cispo" and level == "sequence")
]


@pytest.mark.parametrize("loss_type,level,beta", CASES)
def test_loss_and_gradient_equal_the_reference_formulas(loss_type, level, beta):
    cfg = PolicyLossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=0.1,
        epsilon_high=5.0 if loss_type == "cispo" else 0.15,
        max_completion_length=7,
    )
    rows = _rows()
    model = _model()
    want = _reference(model, rows, cfg)
    want.backward()
    g_want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for select in (True, False):
        got = _ours(model, rows, cfg, select)
        got.backward()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (float(got), float(want))
        for p, g in zip(model.parameters(), g_want):
            assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7)
        model.zero_grad()


def test_capture_puts_each_log_prob_at_its_predicting_column():
    model = _model()
    rows = _rows(4, seed=3)
    obj = GRPOObjective(model, CTX, cfg=PolicyLossConfig(), reference=None, rollout=None)
    backend = SimpleNamespace(model=model)

    def eval_loss(batch, scope, loss_fn, task):
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with scope, loss_fn.scope(labels):
            out = model(**inputs).logits
        return (*loss_fn(out, labels), out)

    backend.eval_loss = eval_loss
    batch, scope = BatchPlan("lm", CTX)(RolloutCollator(pad_id=0)(rows))
    got = obj.capture_logps(backend, batch, scope, reference=False)
    for i, r in enumerate(rows):
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        lp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
        p, n = len(r["prompt_ids"]), len(r["completion_ids"])
        want = lp[p - 1 : p + n - 1].gather(1, torch.tensor(r["completion_ids"])[:, None])[:, 0]
        keep = torch.tensor(r["targets"], dtype=torch.bool)
        assert torch.allclose(got[i, p - 1 : p + n - 1][keep], want[keep], atol=1e-5)
        assert (got[i, p - 1 : p + n - 1][~keep] == 0).all()
