"""The tiny copy's shrink (hfpar.parallel.tiny_copy): the configs of families whose defaults did not shrink into a
model (sub-configs, top-1 routing, layer kinds that first appear deep, hybrids whose first layers hold no cache) now
build one that holds every kind of layer the model has, and it trains. What the family sweeps and hfpar's checks of
a model (packing, prompt sharing, chunked loss, upcycling) run on. One process, CPU, float64, ~10 s.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from benchmarks.tensor_parallel.family_sweep import build, tiny_config
from hfpar.parallel.tiny_copy import layer_sample, shrink, tiny_model


def test_layer_sample_keeps_every_kind_of_layer():
    hybrid = [["linear_attention"] * 3 + ["full_attention"]] * 1
    hybrid = [hybrid[0] * 6]  # 24 layers: full attention every 4th
    assert layer_sample(hybrid, 2) == [0, 3]
    assert layer_sample(hybrid, 8) == list(range(8))  # the first 8 hold both kinds already
    deep = [["sliding_attention"] * 20 + ["full_attention"] + ["sliding_attention"] * 3]
    assert layer_sample(deep, 4) == [0, 1, 2, 20]  # a kind that first appears at layer 20 is kept
    # the lists of numbers (Gemma-3n's per-layer widths) follow the same layers; they define no kind
    assert layer_sample([list(range(24)), deep[0]], 3) == [0, 1, 20]
    assert layer_sample([["a", "b", "c"] * 4], 2) == [0, 1]  # more kinds than layers: the first ones
    assert layer_sample([], 4) == []


def test_a_users_config_keeps_a_layer_kind_that_first_appears_deep():
    kinds = ["sliding_attention"] * 11 + ["full_attention"]
    cfg = AutoConfig.for_model("qwen2", num_hidden_layers=12, layer_types=kinds, use_sliding_window=True)
    tiny = shrink(cfg, 8, keep=True)
    assert tiny.num_hidden_layers == 8
    assert tiny.layer_types == ["sliding_attention"] * 7 + ["full_attention"]


def test_a_top_1_family_stays_top_1_and_sub_configs_shrink():
    zaya = tiny_config("zaya", 4)  # ZAYA validates top-1 routing: its own top-k where the family refuses top-2
    assert zaya.num_experts_per_tok == 1 and zaya.num_experts == 4
    assert tiny_config("hunyuan_v1_moe").moe_topk == 2  # else top-2 (a top-1 router has no gradient to compare)
    dbrx = tiny_config("dbrx", 2)  # its widths live in attn_config / ffn_config: shrunk with the model width
    assert (dbrx.d_model, dbrx.ffn_config.hidden_size, dbrx.ffn_config.ffn_hidden_size) == (64, 64, 128)
    assert (dbrx.ffn_config.moe_num_experts, dbrx.ffn_config.moe_top_k) == (4, 2)
    assert dbrx.num_key_value_heads == dbrx.attn_config.kv_n_heads  # the fused qkv's split agrees with the model


# families whose tiny config did not build or train before (transformers 5.24), and the layer kinds each must hold
NEWLY_BUILT = {
    "dbrx": None,
    "lfm2_moe": ("conv", "full_attention"),
    "kimi_linear": ("linear_attention", "full_attention"),
    "bailing_hybrid": None,
    "zaya": None,
    "jamba": None,
    "bamba": None,
    "granitemoehybrid": None,
    "longcat_flash": None,
    "zamba2": ("linear_attention", "hybrid"),
    "gpt_neo": None,
    "dory": None,
    "cohere_compass_text": None,
    "qwen3_5_moe": ("linear_attention", "full_attention"),
}


@pytest.mark.parametrize("model_type", sorted(NEWLY_BUILT))
def test_families_that_did_not_shrink_build_and_train(model_type):
    model = build(model_type, layers=4)
    text = model.config.get_text_config()
    kinds = NEWLY_BUILT[model_type]
    if kinds is not None:
        have = set(getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ())
        assert set(kinds) <= have, (model_type, have)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_the_checks_copy_of_a_hybrid_runs():
    """hfpar's checks build their copy from the run's own config: a Jamba (attention every 8th layer from the 4th)
    copy of 8 layers holds its attention layer and runs without a cache (use_cache off)."""
    cfg = AutoConfig.for_model("jamba", num_hidden_layers=16)
    model = tiny_model(cfg)
    assert not isinstance(model, str), model
    assert model.config.use_cache is False
    assert "attention" in model.config.layers_block_type
    ids = torch.arange(3, 11).view(1, 8)
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize("model_type", ["bamba", "dots3_note_text", "llama"])
def test_a_checkpoints_config_copies_tiny_in_its_own_class(model_type):
    """What TP's check of a meta skeleton builds (tiny_check.py): a copy of the model's own class from its config at
    full size. Bamba's checkpoint config holds its Mamba heads x head_dim == expand x hidden explicitly (shrunk
    together); Dots3-note gives heads and MLA sizes per layer (transformers' heterogeneous per_layer_config:
    sampled with the layers and shrunk; its sliding layers' head_dim is the whole query head)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from hfpar.parallel.tiny_copy import tiny_like

    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    model = tiny_like(skeleton)
    assert not isinstance(model, str), model
    assert type(model) is type(skeleton) and next(model.parameters()).dtype == torch.float64
    assert sum(p.numel() for p in model.parameters()) < 4_000_000  # Dots3-note's indexer: 3.2M
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()
    if model_type == "dots3_note_text":  # both kinds of layer, each with its own (shrunk) values
        assert set(model.config.layer_types) == {"indexed_attention", "sliding_attention"}
