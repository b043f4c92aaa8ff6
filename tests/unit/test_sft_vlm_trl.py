"""TRL equality for image + text SFT, end to end: hfpar's sft recipe and TRL 1.16's SFTTrainer on the same tiny
vision-language model, rows and batches (one process, in-process, CPU, fp32, 8 optimizer steps, batch 4, clipping
active): per-step loss and grad norm equal within 1e-4 relative. Rows are conversational prompt / completion with
one image each (TRL's vision collator then trains on the completion tokens only, as hfpar does; the image tokens sit
in the prompt); questions and answers of several lengths, so rows are padded. TRL 1.16 defaults to bf16 autocast:
the comparison sets bf16=False (tests/helpers/vlm_sft.py). idefics3 (SmolVLM's architecture) here, llava extended.

    python -m pytest -q -s tests/unit/test_sft_vlm_trl.py -m "slow or extended"
"""

from __future__ import annotations

import pytest

from tests.helpers.vlm_sft import make_vlm_case, run_hfpar, run_trl

pytest.importorskip("trl")
TOL = 1e-4


def _compare(tmp_path, family: str) -> None:
    model, data = make_vlm_case(tmp_path, family)
    trl = run_trl(model, data, str(tmp_path / "trl"))
    ours = run_hfpar(model, data, str(tmp_path / "hfpar"))
    assert len(trl) == len(ours) == 8
    worst = 0.0
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        for key in ("loss", "grad_norm"):
            diff = abs(h[key] - t[key]) / max(abs(t[key]), 1e-12)
            worst = max(worst, diff)
            assert diff <= TOL, f"{family} step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
    assert ours[-1]["loss"] < ours[0]["loss"]
    print(f"TRL {family}: worst relative difference {worst:.2e} over 8 steps (loss, grad_norm)")


@pytest.mark.slow
def test_idefics3_per_step_equal_to_trl(tmp_path):
    _compare(tmp_path, "idefics3")


@pytest.mark.extended
def test_llava_per_step_equal_to_trl(tmp_path):
    _compare(tmp_path, "llava")
