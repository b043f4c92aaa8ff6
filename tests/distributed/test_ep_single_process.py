"""apply_expert_parallel / upcycle_to_moe in one process: refusals before any collective, other MoE families against
HF's own blocks, the upcycled export. The parity of expert-parallel ranks: tests/distributed/test_ep_models.py.

    python -m pytest -q tests/distributed/test_ep_single_process.py
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from hfpar.parallel.sharding import shard_spec
from tests.helpers.ep_models import TINY, TOL, _batch, _build, _rel


# ----------------------------------------------------------------------------- one process
def _fake_world(n):
    return mock.patch.object(dist, "is_initialized", return_value=True), mock.patch.object(
        dist, "get_world_size", return_value=n
    )


def _refused(model, n, match):
    from hfpar.parallel.expert_parallel import apply_expert_parallel

    before = {k: type(m) for k, m in model.named_modules()}
    a, b = _fake_world(n)
    with a, b, pytest.raises(ValueError, match=match) as e:
        apply_expert_parallel(model)
    assert {k: type(m) for k, m in model.named_modules()} == before and not any(
        shard_spec(p) is not None for p in model.parameters()
    )
    return str(e.value)


def test_validation_before_any_collective():
    """No process group exists here: a collective would raise 'not initialized', not these messages."""
    msg = _refused(_build("mixtral", "float32"), 3, r"num_experts 4 is not divisible by ep_size 3")
    assert "model.layers.0.mlp" in msg and "model.layers.1.mlp" in msg
    _refused(
        _build("mixtral", "float32", num_experts_per_tok=5),
        2,
        r"model\.layers\.0\.mlp: top_k 5 must be in \[1, num_experts 4\]",
    )
    _refused(_build("llama", "float32"), 2, r"'llama' is not a supported MoE architecture .*upcycle_to_moe")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    msg = _refused(
        gpt2,
        2,
        r"'gpt2' is not a supported MoE architecture "
        r"\(supported: mixtral, olmoe, qwen2_moe, qwen3_moe, or any block with 3-D experts",
    )
    assert "upcycle_to_moe" in msg


def test_upcycle_refusals():
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfpar.parallel.expert_parallel import apply_expert_parallel, upcycle_to_moe, upcycled_hf_config

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(
        ValueError, match=r"no SwiGLU MLP \(gate_proj / up_proj / down_proj Linear layers\) in this gpt2"
    ):
        upcycle_to_moe(gpt2, 4)
    with pytest.raises(ValueError, match=r"this mixtral model has experts already"):
        upcycle_to_moe(_build("mixtral", "float32"), 4)
    with pytest.raises(ValueError, match=r"top_k 5 must be in \[1, num_experts 4\]"):
        upcycle_to_moe(_build("llama", "float32"), 4, top_k=5)
    with pytest.raises(ValueError, match=r"mlp_bias=True"):
        upcycle_to_moe(_build("llama", "float32", mlp_bias=True), 4)
    m = upcycle_to_moe(_build("llama", "float32", attention_bias=True), 4)
    with pytest.raises(ValueError, match=r"this llama model cannot be exported: no HF MoE architecture reproduces"):
        upcycled_hf_config(m)  # Mixtral has no attention bias: no candidate computes what it computes
    apply_expert_parallel(m)  # no process group: ep=1, fine
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(m)


@pytest.mark.parametrize("mt", ["qwen3_moe", "olmoe"])
def test_other_families_match_hf(mt):
    """Families in the table beyond the distributed cases: same logits and state-dict keys at ep=1."""
    from hfpar.parallel.expert_parallel import apply_expert_parallel
    from hfpar.parallel.expert_parallel.moe import MoELayer

    hf = _build(mt).eval()
    ids, mask = _batch(0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
    keys = sorted(hf.state_dict())
    model = apply_expert_parallel(copy.deepcopy(hf))
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == TINY["num_hidden_layers"]
    with torch.no_grad():
        assert _rel(model(ids, attention_mask=mask).logits, want) < TOL["float64"]
    assert sorted(model.state_dict()) == keys


@pytest.mark.parametrize(
    "mt, target",
    [("mistral", "MixtralForCausalLM"), ("qwen3", "Qwen3MoeForCausalLM"), ("olmo2", "FlexOlmoForCausalLM")],
)
def test_upcycle_export_single_process(tmp_path, mt, target):
    """The export target is found by what the models compute (upcycle_check), not a table: OLMo-2 -> FlexOlmo too."""
    from transformers import AutoModelForCausalLM

    from hfpar.parallel.expert_parallel import save_upcycled_pretrained, upcycle_to_moe

    dense = _build(mt).eval()
    ids, mask = _batch(1)
    with torch.no_grad():
        want = dense(ids, attention_mask=mask).logits
        model = upcycle_to_moe(copy.deepcopy(dense), 4, top_k=2, seed=3)
        got = model(ids, attention_mask=mask).logits
        assert _rel(got, want) < TOL["float64"]  # renormalized top-k of identical experts
        again = upcycle_to_moe(copy.deepcopy(dense), 4, top_k=2, seed=3)
        assert torch.equal(again.model.layers[1].mlp.gate.weight, model.model.layers[1].mlp.gate.weight)
    save_upcycled_pretrained(model, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    assert type(loaded).__name__ == target
    with torch.no_grad():
        assert _rel(loaded(ids, attention_mask=mask).logits, got) < TOL["float64"]
