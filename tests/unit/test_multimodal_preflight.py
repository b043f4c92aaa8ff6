"""The preflight and the planner on multimodal wrappers (the language model's settings in `config.text_config`): sized
by the language model, never an AttributeError, and what cannot work refused in one line before any model loads.

    gemma3 (Gemma3ForConditionalGeneration, what AutoModelForCausalLM builds): TP / CP divisibility read from its
        gemma3_text config, PP refused (preflight, planner rows, --pp_size), the decoder layers and the TP-replicated
        parameters counted from the language model and the vision tower
    llava (AutoModelForImageTextToText only): refused by the causal-LM recipes' preflight and the planner, naming
        its text model
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar import preflight as pf
from hfpar.context import ParallelContext
from hfpar.planner.candidates import candidates
from hfpar.planner.memory import PlannerError
from hfpar.planner.pipeline import pipeline_estimate
from hfpar.planner.table import memory_table, model_stats
from tests.helpers.preflight import _args


def _saved(model_type: str):
    """The family sweep's tiny config with `architectures` as a saved checkpoint's config.json has it."""
    cfg = tiny_config(model_type)
    cfg.architectures = [(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES | MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)[model_type]]
    return cfg


@pytest.fixture(scope="module")
def gemma3():
    return _saved("gemma3")  # text: 4 heads, 2 kv heads, 2 layers, vocab 128; a shrunk SigLIP tower


def test_preflight_sizes_a_wrapper_by_its_language_model(gemma3):
    assert pf.model_problems(_args("--tp_size", "2"), ParallelContext(world=2, tp=2), "lm", gemma3) == []
    bad = pf.model_problems(_args("--tp_size", "3"), ParallelContext(world=3, tp=3), "lm", gemma3)
    assert any("gemma3_text's num_attention_heads 4 is not divisible" in p for p in bad), bad
    assert all("\n" not in p for p in bad), bad
    ulysses = _args("--cp_size", "2", "--cp_mode", "ulysses")
    cp = pf.model_problems(ulysses, ParallelContext(world=2, cp=2), "lm", gemma3)
    assert cp == [], cp  # the probe checks the language model's attention; heads read from gemma3_text


def test_preflight_refuses_pipeline_stages_on_a_wrapper_in_one_line(gemma3):
    (why,) = pf.model_problems(_args("--pp_size", "2"), ParallelContext(world=2, pp=2), "lm", gemma3)
    assert why.startswith("--pp_size 2: model_type 'gemma3' (Gemma3ForConditionalGeneration) nests its language "), why
    assert "valid: pp_size 1" in why and "\n" not in why, why


def test_preflight_refuses_a_type_only_image_text_to_text_builds():
    (why,) = pf.model_problems(_args("--tp_size", "2"), ParallelContext(world=2, tp=2), "lm", _saved("llava"))
    assert "model_type 'llava' (LlavaForConditionalGeneration) has no causal-LM class" in why, why
    assert "its language model alone (model_type 'llama') does" in why and "\n" not in why, why


def test_planner_counts_the_language_model_and_refuses_pipelines(gemma3):
    stats = model_stats(gemma3)
    assert (stats.heads, stats.kv_heads, stats.n_layers, stats.vocab) == (4, 2, 2, 128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma3)
    lm = model.model.language_model
    assert stats.n_layer_params == sum(p.numel() for p in lm.layers.parameters())  # not the tower's layers
    tower = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.language_model."))
    assert stats.n_tp_replicated >= tower - stats.n_head_untied  # the tower stays whole on every TP rank
    assert stats.pipeline_refusal and not any(c.pp > 1 for c in candidates(stats, 8, 8))
    with pytest.raises(PlannerError, match=r"^--pp_size 2: model_type 'gemma3' .*valid: pp_size 1"):
        pipeline_estimate(stats, pp=2, world=2)
    text, best = memory_table(gemma3, "tiny-gemma3", num_gpus=2, gpu_memory_gb=80)
    assert best is not None and best.pp == 1, text


def test_planner_refuses_a_type_only_image_text_to_text_builds():
    with pytest.raises(PlannerError, match=r"^model_type 'llava' .*its language model alone") as exc:
        model_stats(_saved("llava"))
    assert "\n" not in str(exc.value)
