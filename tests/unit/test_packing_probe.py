"""hfpar.data.packing_probe: whether padding-free rows keep a model's samples apart, decided by running a tiny copy of
the model's own config, not by a list of family names.

- Families of every kind get the answer their code implies: attention-only decoders (Llama-style, Cohere-2's
  sliding + global layers, GLM-4, Phi, OLMo, GPT-NeoX, DeepSeek-V3's MLA and MoE, Llama-4's chunked attention,
  Gemma-3's windows) keep samples apart; masks built without the position ids (OPT, BLOOM's ALiBi), layers that carry
  state along the row (Mamba, Jamba, Falcon-H1, Qwen3-Next's and MiniMax's linear attention, LFM2's convolutions)
  and bidirectional encoders (BERT, CamemBERT as decoders) do not, nor does Llama 4's attention temperature (its NoPE
  layers scale queries by the index in the row, not the position id: a packed sample past floor_scale tokens into
  the row is scaled as that index; seen since the tiny copy shrinks floor_scale, 8192 by default).
- The run's own config counts, not its family's defaults: LFM2 with convolution layers leaks, LFM2 without them
  does not.
- The answer matches the recipe's: tests/launch/test_padding_free_recipe.py trains Cohere-2 padding-free and padded.
- No side effect: the global RNG is left as it was; the answer is computed once per config and attention.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from hfpar.data.packing_probe import packing_problem

APART = ["llama", "cohere2", "glm4", "phi", "olmo", "gpt_neox", "deepseek_v3", "gemma3_text", "granite"]
MIXED = {  # model_type: what the probe's reason says
    "opt": "see each other",
    "bloom": "see each other",
    "mamba": "see each other",
    "jamba": "see each other",
    "falcon_h1": "see each other",
    "qwen3_next": "see each other",
    "minimax": "see each other",
    "bert": "see each other",
    "camembert": "see each other",
    "llama4_text": "positions not restarted",  # its attention temperature: the index in the row
}


@pytest.mark.parametrize("model_type", APART)
def test_decoders_that_keep_packed_samples_apart(model_type):
    assert packing_problem(AutoConfig.for_model(model_type)) is None


@pytest.mark.parametrize("model_type", sorted(MIXED))
def test_models_whose_packed_samples_mix(model_type):
    why = packing_problem(AutoConfig.for_model(model_type))
    assert why is not None and MIXED[model_type] in why and "\n" not in why, why


def test_the_runs_own_config_decides():
    conv = AutoConfig.for_model("lfm2", num_hidden_layers=8, layer_types=["conv", "full_attention"] * 4)
    attention_only = AutoConfig.for_model("lfm2", num_hidden_layers=8, layer_types=["full_attention"] * 8)
    assert "see each other" in packing_problem(conv)
    assert packing_problem(attention_only) is None
    # Llama 4 without its attention temperature: the chunked attention alone keeps packed samples apart
    assert packing_problem(AutoConfig.for_model("llama4_text", attn_temperature_tuning=False)) is None
    # an attention the family lacks is the run's: BLOOM has no sdpa, so its tiny copy cannot run it
    assert "could not be checked" in packing_problem(AutoConfig.for_model("bloom"), "sdpa")


def test_no_side_effects_and_one_check_per_config():
    cfg = AutoConfig.for_model("qwen2", num_hidden_layers=3)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    assert packing_problem(cfg) is None
    assert torch.equal(torch.rand(3), want)  # the probe's seeded init forked the RNG
    cfg.num_hidden_layers = 3  # the same config again: the cached answer
    assert packing_problem(cfg) is None and cfg.num_hidden_layers == 3
    custom = AutoConfig.for_model("llama")
    custom.auto_map = {"AutoModelForCausalLM": "modeling.Model"}
    assert "custom code" in packing_problem(custom)
