"""The recipes find MoE models with the library's detection, not a family table (hfpar.parallelize.apply_moe,
hfpar.preflight): the config's routed-expert count before loading, the model's blocks after; without --ep_size a block
hfpar cannot convert trains as the HF model's own (a one-line note), never refused, unless an aux loss would be lost.
One process, tiny models built from configs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar.parallel.expert_parallel import config_num_experts, has_moe_blocks
from hfpar.parallelize import apply_moe

ARGS = SimpleNamespace(upcycle_experts=0, gradient_accumulation_steps=1, seed=0)
CTX = SimpleNamespace(ep=1, pp=1, grad_replicas=1)


def _model(model_type: str, **over):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize(
    "model_type, experts",
    [("deepseek_v3", 256), ("gpt_oss", 128), ("ernie4_5_moe", 64), ("llama4_text", 16), ("jetmoe", 8), ("llama", None)],
)
def test_config_num_experts(model_type, experts):
    from transformers import AutoConfig

    assert config_num_experts(AutoConfig.for_model(model_type)) == experts


def test_unconvertible_blocks_train_as_hf_without_ep():
    model = _model("jetmoe")
    assert has_moe_blocks(model)
    before = {n: p for n, p in model.named_parameters()}
    note = apply_moe(model, ARGS, CTX)
    assert note.startswith(
        "MoE blocks train as the HF model's own (model.layers.0.mlp.input_linear "
        "(JetMoeParallelExperts) cannot be sharded by expert"
    ), note
    assert "\n" not in note
    assert all(p is before[n] for n, p in model.named_parameters())


def test_hf_blocks_without_ep_stay_hf_but_an_aux_loss_is_refused():
    model = _model("ernie4_5_moe")
    experts = type(model.model.layers[1].mlp.experts)
    before = {n: p for n, p in model.named_parameters()}
    assert has_moe_blocks(model) and apply_moe(model, ARGS, CTX) is None
    # the HF block and its router stay; its plain SwiGLU experts run hfpar's CPU kernel (a subclass), same tensors
    assert isinstance(model.model.layers[1].mlp.experts, experts)
    assert all(p is before[n] for n, p in model.named_parameters())
    aux = _model("ernie4_5_moe", output_router_logits=True, router_aux_loss_coef=0.01)
    with pytest.raises(
        ValueError,
        match=r"^output_router_logits with router_aux_loss_coef 0\.01: the recipes add the "
        r"aux loss through hfpar's MoE router only, and model\.layers\.1\.mlp\.experts"
        r" \(Ernie4_5_MoeSparseMoeBlock\) keeps the HF block's own router",
    ) as e:
        apply_moe(aux, ARGS, CTX)
    assert "\n" not in str(e.value)


def test_dense_model_has_no_moe_blocks():
    assert not has_moe_blocks(_model("llama"))


def test_a_block_with_its_own_routing_state_keeps_its_hf_code():
    """LFM2-MoE's block holds expert_bias (a score correction, zero at init: a probe of the fresh block cannot tell
    it from plain softmax top-k); its blocks are not converted to hfpar's router but keep the HF code, only the
    experts sharded (hf_experts), whatever a checkpoint's bias is."""
    from hfpar.parallel.expert_parallel.families import find_moe_blocks
    from hfpar.parallel.expert_parallel.hf_experts import find_hf_experts

    model = _model("lfm2_moe")
    blocks, problems = find_moe_blocks(model, lambda *a: 0.0)  # a probe that would accept anything
    assert not blocks and len(problems) == 1, (blocks, problems)
    assert "holds expert_bias itself (bias-corrected routing is not supported)" in problems[0], problems
    found, why = find_hf_experts(model)
    assert [f.path for f in found] == ["model.layers.1.feed_forward.experts"] and not why
