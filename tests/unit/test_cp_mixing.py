"""Context parallelism and models that mix tokens outside their attention (hfpar.parallel.context_parallel.mixing):
the run's tiny float64 copy, its attention replaced by one where each token sees itself only, one token of a row
changed, every module's output at the other positions compared. Decided by what the model does: the Mamba,
gated-DeltaNet / linear-attention or short-convolution module of each hybrid family is found (every kind, not only
the first), and is run on the whole rows under CP (gathered.py); a mixer that calls the attention itself (short
convolutions over k / v inside the attention module) is refused, named; families whose tokens meet only in the
attention have none; a module made to mix tokens is found (the check can fail), and the cut-rows check refuses a
gather that puts the rows back in the wrong order (it can fail too). One process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from hfpar.parallel.context_parallel import enable_cp_attention, gathered
from hfpar.parallel.context_parallel.gathered import GATHERED
from hfpar.parallel.context_parallel.mixing import SELF_ONLY, Mixers, _mixing, token_mixers, token_mixing_problem
from hfpar.parallel.context_parallel.shard_check import shard_problem
from hfpar.parallel.tiny_copy import tiny_model

GATHERED_MIXERS = {  # model_type: the classes of the modules that carry state along the row, run on whole rows
    "jamba": ("JambaMambaMixer",),
    "qwen3_next": ("Qwen3NextGatedDeltaNet",),
    "qwen3_5_text": ("Qwen3_5GatedDeltaNet",),
    "falcon_h1": ("FalconH1Mixer",),
    "nemotron_h": ("NemotronHMamba2Mixer",),
    "lfm3": ("Lfm3ShortConv",),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet",),
}
# short convolutions over k / v INSIDE the attention module, which calls the registry: accepted by the meta probe,
# and cannot run on whole rows (its attention would be CP's)
REFUSED = {
    "inkling_text": "model.layers.0.self_attn (InklingAttention)",
    "zaya": "model.layers.0.self_attn (ZayaAttention)",
}
CLEAN = ("llama", "gemma2", "cohere2", "olmo2", "deepseek_v3", "qwen3_moe", "gpt2", "llama4_text", "gemma3n_text")


@pytest.mark.parametrize("model_type", sorted(GATHERED_MIXERS))
def test_state_along_the_row_is_found_and_gathered(model_type):
    classes, why = token_mixers(AutoConfig.for_model(model_type))
    assert why is None and tuple(c.rsplit(".", 1)[-1] for c in classes) == GATHERED_MIXERS[model_type], classes


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_mixer_that_calls_the_attention_is_refused(model_type):
    why = token_mixing_problem(AutoConfig.for_model(model_type))
    assert why is not None and why.startswith(REFUSED[model_type]), why
    assert "mixes tokens outside the attention" in why and "calls the attention itself" in why and "\n" not in why


@pytest.mark.parametrize("model_type", CLEAN)
def test_tokens_that_meet_only_in_the_attention_pass(model_type):
    assert token_mixers(AutoConfig.for_model(model_type)) == ((), None)


class _TokenShift(nn.Module):
    """Adds the previous token's hidden state (RWKV's token shift): a mixer the check must find."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs.pop("hidden_states")
        return self.inner(x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1], *args[1:], **kwargs)


def test_a_module_made_to_mix_tokens_is_found():
    from transformers import AttentionInterface

    from hfpar.parallel.context_parallel.mixing import _self_only

    AttentionInterface.register(SELF_ONLY, _self_only)
    model = tiny_model(AutoConfig.for_model("llama"), SELF_ONLY)
    assert _mixing(model) == Mixers()
    model.model.layers[1].mlp = _TokenShift(model.model.layers[1].mlp)
    assert _mixing(model) == Mixers((f"{__name__}._TokenShift",), ("model.layers.1.mlp (_TokenShift)",))
    model.model.layers[0].self_attn = _TokenShift(model.model.layers[0].self_attn)  # wraps a module that attends
    why = _mixing(model)
    assert isinstance(why, str) and why.startswith("model.layers.0.self_attn (_TokenShift) mixes tokens"), why
    assert "calls the attention itself" in why


def test_enable_cp_attention_gathers_the_mixers_in_users_code():
    model = tiny_model(AutoConfig.for_model("lfm3"))
    with pytest.warns(
        UserWarning, match=r"modules mix tokens outside the attention \(model.layers.0.conv, \.\.\.: Lfm3"
    ):
        enable_cp_attention(model)
    convs = [n for n, m in model.named_modules() if getattr(m, GATHERED, False)]
    assert convs and all(n.endswith(".conv") for n in convs), convs


def test_a_gather_in_the_wrong_order_is_refused(monkeypatch):
    """The cut-rows check runs the gathered mixers over emulated ranks: rows put back in gathered (rank) order instead
    of position order train something else, and the check names it."""
    monkeypatch.setattr(gathered, "_position_order", lambda rows: torch.arange(rows.order.numel()))
    config = AutoConfig.for_model("lfm3", vocab_size=97)  # a config of its own: the checks' answers are per config
    why = shard_problem(config)
    assert why is not None and "differs by" in why and "when its rows are cut" in why, why


def test_a_gated_deltanet_hybrid_cut_over_emulated_ranks_computes_what_it_computes_whole():
    """Qwen3.5's gated DeltaNet (float32 kernels) beside full attention, small: the cut-rows check with its mixers on
    whole rows passes (its gradients within the one-process noise floor, split_noise)."""
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    assert shard_problem(config) is None
