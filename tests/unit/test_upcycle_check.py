"""hfpar.parallel.expert_parallel.upcycle_check: the HF MoE architecture an upcycled model is saved as is the one that
computes what it computes, found on a tiny copy of the run's config (was: a table of three families).

- Llama-style decoders go to Mixtral, Qwen3 to Qwen3-MoE, OLMo-2 to FlexOlmo (the export itself, loaded back by
  from_pretrained with the upcycled logits: tests/distributed/test_ep_single_process.py).
- Refused in one line, with the reason: no SwiGLU MLP (GPT-2, Phi-3's fused gate_up), a MoE config already, bias in
  the MLPs, and decoders no candidate reproduces (Qwen2, Gemma, a Llama with attention_bias).
- The check can fail: an MLP that is not the SwiGLU upcycle_to_moe rebuilds (another activation) is refused.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from hfpar.parallel.expert_parallel import upcycle_check, upcycle_problem
from hfpar.parallel.expert_parallel.upcycle_check import export_target

EXPORTED = {
    "llama": "mixtral",
    "mistral": "mixtral",
    "ministral": "mixtral",
    "qwen3": "qwen3_moe",
    "olmo2": "flex_olmo",
}
REFUSED = {  # (model_type, config overrides): what the one-line reason says
    ("gpt2", ()): "no SwiGLU MLP",
    ("phi3", ()): "no SwiGLU MLP",
    ("mixtral", ()): "has experts already",
    ("llama", (("mlp_bias", True),)): "projections with bias are not supported (mlp_bias=True)",
    ("llama", (("attention_bias", True),)): "no HF MoE architecture reproduces",
    ("qwen2", ()): "no HF MoE architecture reproduces",
    ("gemma", ()): "no HF MoE architecture reproduces",
}


@pytest.mark.parametrize("model_type", sorted(EXPORTED))
def test_export_target_found_by_what_the_models_compute(model_type):
    target = export_target(AutoConfig.for_model(model_type))
    assert not isinstance(target, str), target
    assert target.model_type == EXPORTED[model_type]


@pytest.mark.parametrize(("model_type", "over"), sorted(REFUSED))
def test_refused_in_one_line_with_the_reason(model_type, over):
    why = upcycle_problem(AutoConfig.for_model(model_type, **dict(over)))
    assert why is not None and "\n" not in why and REFUSED[model_type, over] in why, why


def test_an_mlp_upcycling_would_change_is_refused(monkeypatch):
    """The experts apply another activation than the dense MLP: the upcycled model no longer computes the dense one."""
    monkeypatch.setattr("hfpar.parallel.expert_parallel.upcycle.mlp_activation", lambda config: "relu")
    why = upcycle_check.upcycle_problem(AutoConfig.for_model("llama", num_hidden_layers=3))
    assert why is not None and "do not compute the dense MLPs" in why, why
