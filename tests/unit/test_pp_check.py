"""Pipeline stages against the unsplit model, decided by what the model does (hfpar.parallel.pipeline.check), one
process, float64:

    python -m pytest tests/unit/test_pp_check.py -q

- families whose stages computed other math without an error before (a final norm by another name applied on every
  stage: Phi, GPT-NeoX, Persimmon, Nemotron-H, LFM2, ModernBERT-decoder; nanochat's norm, run before and after the
  layers, removed from the first stage; LongCat-Flash's loop over num_layers) now compose to the unsplit model,
  measured here by stages built directly, independently of the check's own code, and the check accepts them;
- families whose base model does more than hand hidden states from layer to layer (Gemma-3n's per-layer inputs and
  four streams, Inkling-2) are refused in one line by the check, by PipelineStage itself and by the preflight.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.tensor_parallel.family_sweep import build, tiny_config
from hfpar.parallel.pipeline import PipelineStage, pipeline_problem

WERE_WRONG = ["phi", "gpt_neox", "persimmon", "nemotron_h", "lfm2", "modernbert-decoder", "nanochat", "longcat_flash"]


@pytest.mark.parametrize("model_type", [*WERE_WRONG, "llama"])
def test_two_stages_compose_to_the_unsplit_model(model_type):
    model = build(model_type, layers=4).eval()
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        first = PipelineStage(copy.deepcopy(model), 0, [0, 2, 4])
        last = PipelineStage(copy.deepcopy(model), 1, [0, 2, 4])
        out = last(first(ids, position_ids=pos), position_ids=pos)
    assert (out - ref).abs().max() <= 1e-10 * ref.abs().max(), model_type
    assert pipeline_problem(tiny_config(model_type, 4)) is None


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("gemma3n_text", "the stage of layer 0 does not run alone"),
        ("inkling2_text", "the states a stage hands on after layer 1 differ from the unsplit model's by"),
    ],
)
def test_a_model_whose_layers_are_not_a_plain_chain_is_refused(model_type, why):
    cfg = tiny_config(model_type, 4)
    got = pipeline_problem(cfg)
    assert got is not None and why in got and "\n" not in got, got
    with pytest.raises(ValueError, match="stages would not compute it"):
        PipelineStage(build(model_type, layers=4), 0, [0, 2, 4])


def test_the_preflight_refuses_it_before_the_model_loads():
    from types import SimpleNamespace

    from hfpar.preflight import pp_model_problems

    args = SimpleNamespace(pp_split=None, pp_virtual_stages=None, pp_schedule="1f1b", pp_size=2)
    ctx = SimpleNamespace(pp=2)
    got = pp_model_problems(args, ctx, tiny_config("gemma3n_text", 4))
    assert len(got) == 1 and got[0].startswith("--pp_size 2: pipeline stages of ") and "valid: pp_size 1" in got[0]
    assert pp_model_problems(args, ctx, tiny_config("phi", 4)) == []
