"""TRL equality, end to end: hfpar's dpo recipe and TRL 1.16's DPOTrainer on the same tiny Llama, pairs and batches
(one process, in-process, CPU, fp32, 8 optimizer steps, clipping active): per-step loss, grad norm and rewards/*
equal within 1e-4 relative; with a separate reference model (TRL loads a second copy; hfpar swaps a frozen copy
of its parameters in) and with precomputed reference log-probs. Every loss type's formula is held to TRL's own
code in tests/unit/test_dpo.py; here sigmoid (TRL's default), ipo (per-token averages: the completion lengths) and,
in one run pair, robust (label smoothing 0.1), apo_zero and sppo_hard as TRL's weighted multi-loss (their gradients
all shape the trajectory) run through both trainers.

The rewards are beta x (policy - reference) log-probs of sequences whose log-probs are ~-100: early in training
they are differences of nearly equal numbers, so they (and rewards/margins) are compared within 1e-4 relative or
1e-4 x beta absolute (1e-5: fp32 round-off of the log-probs, 1e-7 relative, is ~1e-6 there)."""

from __future__ import annotations

import json

import pytest

from benchmarks.dpo.trl_compare import make_case, run_hfpar, run_trl

pytest.importorskip("trl")
TOL = 1e-4
BETA = 0.1  # the helper's default
MULTI = ("robust,apo_zero,sppo_hard", "1,0.5,0.02")  # sppo_hard's squares start at 2 x (0.5 / beta)^2 = 50
CASES = [("sigmoid", 0.0, False), ("ipo", 0.0, False), ("sigmoid", 0.0, True), (MULTI[0], 0.1, False)]
pytestmark = (
    pytest.mark.slow
)  # two trainers x 3 cases, ~10 s each on an idle machine: the full suite, not the fast subset


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("dpo_trl"))


def _close(a: float, b: float, scale: float | None = None) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b), scale or 0.0, 1e-8)


@pytest.mark.parametrize(
    "loss_type,smoothing,precompute",
    CASES,
    ids=[f"{c[0]}{'-precomputed' if c[2] else ''}".replace(",", "+") for c in CASES],
)
def test_per_step_equal_to_trl(case, tmp_path, loss_type, smoothing, precompute):
    kw = {
        "loss_type": loss_type,
        "label_smoothing": smoothing,
        "precompute": precompute,
        "loss_weights": MULTI[1] if loss_type == MULTI[0] else None,
    }
    trl = run_trl(*case, str(tmp_path / "trl"), **kw)
    ours = run_hfpar(*case, str(tmp_path / "hfpar"), **kw)
    assert len(trl) == len(ours) == 8
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert _close(h[key], t[key]), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert _close(h[key], t[key], BETA), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
        assert h["rewards/accuracies"] == t["rewards/accuracies"], f"step {step}"
    assert ours[0]["num_target_tokens"] == 4  # the pairs of the step (the unit of the DPO loss)


def test_a_family_whose_mask_ignores_position_ids_trains_through_shared_rows(tmp_path):
    """OPT builds its causal mask without the position ids, so two documents of one plain pair row would see each
    other (hfpar.data.packing_probe); its shared-prompt rows carry their own mask (hfpar.data.share_probe), so the
    recipe trains it and equals TRL's padded pairs (was refused: the plain layout's packed documents)."""
    # GELU for OPT's ReLU: a ReLU unit at ~0 flips on fp32 round-off, so TRL's own trajectory moved by 2.7e-4 (step 3
    # grad norm) between 1 and 2 CPU threads while hfpar's did not; smooth, both agree to 4e-6 on either
    sizes = {"ffn_dim": 128, "word_embed_proj_dim": 64, "max_position_embeddings": 256, "dropout": 0.0}
    sizes["activation_function"] = "gelu"
    case = make_case(tmp_path / "case", model_type="opt", config_updates=sizes)
    trl = run_trl(*case, str(tmp_path / "trl"))
    ours = run_hfpar(*case, str(tmp_path / "hfpar"))
    assert json.loads((tmp_path / "hfpar" / "run_info.json").read_text())["dpo_shared_prompt"] is True
    assert len(trl) == len(ours) == 8
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert _close(h[key], t[key]), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"


def test_dropout_off_as_trl_does(tmp_path):
    """TRL's DPOConfig.disable_dropout (default true) zeroes every dropout module of the policy (and reference):
    hfpar's --disable_dropout (same default) too, so a family with dropout modules (Phi-3's resid / embd pdrop) takes
    TRL's steps; with dropout left on, its first step's policy would differ from its reference (loss != ln 2)."""
    case = make_case(tmp_path / "case", model_type="phi3", config_updates={"resid_pdrop": 0.1, "embd_pdrop": 0.1})
    trl = run_trl(*case, str(tmp_path / "trl"), steps=3)
    ours = run_hfpar(*case, str(tmp_path / "hfpar"), steps=3)
    assert abs(ours[0]["loss"] - 0.6931471805599453) < 1e-6, ours[0]["loss"]
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert _close(h[key], t[key]), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
