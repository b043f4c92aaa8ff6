"""Context parallelism refuses models that mix tokens outside their attention (hfpar.parallel.context_parallel.mixing):
the run's tiny float64 copy, its attention replaced by one where each token sees itself only, one token of a row
changed, every module's output at the other positions compared. Decided by what the model does: families with
Mamba, gated-DeltaNet / linear attention or short-convolution layers are named by the layer's module; families whose
tokens meet only in the attention pass; a module made to mix tokens is found (the check can fail). One process, ~5 s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from hfpar.parallel.context_parallel import enable_cp_attention
from hfpar.parallel.context_parallel.mixing import SELF_ONLY, _mixing, token_mixing_problem
from hfpar.parallel.tiny_copy import tiny_model

MIXING = {  # model_type: the module of its first layer that carries state along the row
    "jamba": "model.layers.0.mamba (JambaMambaMixer)",
    "qwen3_next": "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)",
    "qwen3_5_text": "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet)",
    "falcon_h1": "model.layers.0.mamba (FalconH1Mixer)",
    "nemotron_h": "model.layers.0.mixer (NemotronHMamba2Mixer)",
    "lfm3": "model.layers.0.conv (Lfm3ShortConv)",
    "olmo_hybrid": "model.layers.0.linear_attn",
    # short convolutions over k / v INSIDE the attention module, which calls the registry: accepted by the meta probe
    "inkling_text": "model.layers.0.self_attn (InklingAttention)",
    "zaya": "model.layers.0.self_attn (ZayaAttention)",
}
CLEAN = ("llama", "gemma2", "cohere2", "olmo2", "deepseek_v3", "qwen3_moe", "gpt2", "llama4_text", "gemma3n_text")


@pytest.mark.parametrize("model_type", sorted(MIXING))
def test_state_along_the_row_is_named(model_type):
    why = token_mixing_problem(AutoConfig.for_model(model_type))
    assert why is not None and why.startswith(MIXING[model_type]), why
    assert "mixes tokens outside the attention" in why and "\n" not in why


@pytest.mark.parametrize("model_type", CLEAN)
def test_tokens_that_meet_only_in_the_attention_pass(model_type):
    assert token_mixing_problem(AutoConfig.for_model(model_type)) is None


class _TokenShift(nn.Module):
    """Adds the previous token's hidden state (RWKV's token shift): a mixer the check must find."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1])


def test_a_module_made_to_mix_tokens_is_found():
    from transformers import AttentionInterface

    from hfpar.parallel.context_parallel.mixing import _self_only

    AttentionInterface.register(SELF_ONLY, _self_only)
    model = tiny_model(AutoConfig.for_model("llama"), SELF_ONLY)
    assert _mixing(model) is None
    model.model.layers[1].mlp = _TokenShift(model.model.layers[1].mlp)
    why = _mixing(model)
    assert why is not None and why.startswith("model.layers.1.mlp (_TokenShift) mixes tokens"), why


def test_enable_cp_attention_refuses_it_in_users_code():
    model = tiny_model(AutoConfig.for_model("qwen3_next"))
    with pytest.raises(
        ValueError, match=r"^context parallelism: model.layers.0.linear_attn \(Qwen3NextGatedDeltaNet\)"
    ):
        enable_cp_attention(model)
