"""Tensor parallelism applied to a meta skeleton (what the recipes' sharded loading does before any weight is read):
the plan is verified on a tiny float64 copy of the model (hfpar.parallel.tensor_parallel.tiny_check), on 2 gloo ranks
(one spawn):

    python -m pytest tests/distributed/test_tp_meta_verify.py -q

Skeletons of the families' DEFAULT configs (real sizes: Llama 7B, Gemma-3n E4B, Qwen3-Next 80B; no memory, meta):
- Llama (written plan) and Qwen3-Next (derived plan: gated-DeltaNet and full attention, MoE) are accepted with no
  "not verified" warning, and the skeleton is sharded;
- Gemma-3n's activation-sparse MLPs (a Gaussian top-k over the intermediate width: sharded, its statistics differ)
  are found on the tiny copy before any weight is read and kept whole (its attention sharded), or refused in one
  line under sequence parallelism (before this check the recipes trained them wrongly with one warning: step-1 loss
  2.1e-4 apart);
- a wrong user plan (OLMo-2's all-heads q/k norms as per-head) is refused on the skeleton as on loaded weights;
- an inferred plan (GPT-BigCode) is accepted, its other blocks checked on the tiny copy;
- a config with custom code (auto_map) is applied unverified with one warning saying why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from hfpar.parallel.sharding import shard_spec
from tests.helpers.dist import run_distributed
from tests.helpers.tp_models import OLMO2_PER_HEAD


def _skeleton(model_type: str, **kw):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **kw)
    with init_empty_weights(include_buffers=False):  # as the recipes' skeleton (hfpar.loading.sharded)
        return AutoModelForCausalLM.from_config(cfg)


def _apply(model, **kw) -> tuple[str, list[str], bool]:
    """(outcome: 'accepted' or the refusal, the apply's warnings, whether any parameter got a TP shard)."""
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        try:
            apply_tensor_parallel(model, dist.group.WORLD, **kw)
            outcome = "accepted"
        except ValueError as e:
            outcome = str(e)
    said = [str(w.message) for w in got if "apply_tensor_parallel" in str(w.message)]
    return outcome, said, any(shard_spec(p) is not None for p in model.parameters())


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    res = {}
    res["llama"] = _apply(_skeleton("llama"))
    res["qwen3_next"] = _apply(_skeleton("qwen3_next"))
    gemma = _skeleton("gemma3n_text")
    res["gemma3n"] = _apply(gemma)
    layer = gemma.model.layers[0]
    res["gemma3n_mlp_sharded"] = shard_spec(layer.mlp.down_proj.weight) is not None
    res["gemma3n_attn_sharded"] = shard_spec(layer.self_attn.q_proj.weight) is not None
    res["gemma3n_sp"] = _apply(_skeleton("gemma3n_text"), sequence_parallel=True)
    res["olmo2_wrong"] = _apply(_skeleton("olmo2"), plan=OLMO2_PER_HEAD)
    res["bigcode"] = _apply(_skeleton("gpt_bigcode", multi_query=False, vocab_size=50304))
    custom = _skeleton("llama")
    custom.config.auto_map = {"AutoModelForCausalLM": "modeling_mine.MyLlama"}
    res["custom"] = _apply(custom)
    return res


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout=600)


def test_sound_plans_on_a_skeleton_are_verified_and_applied(ranks):
    for r in ranks:
        for case in ("llama", "qwen3_next"):
            outcome, said, sharded = r[case]
            assert outcome == "accepted" and sharded, (case, outcome)
            assert not [w for w in said if "not verified" in w], (case, said)


def test_activation_sparse_mlps_kept_whole_before_any_weight_is_read(ranks):
    """Gemma-3n's derived plan shards its MLPs, whose Gaussian top-k spans the intermediate width: the tiny copy's
    check names the MLP, the MLP region is kept whole on every rank and the rest (attention, embedding, LM head)
    verified again; under sequence parallelism refused in one line (a kept-whole MLP would see part of the tokens,
    so a derived plan is never cut down there; Gemma-3n's stack is refused earlier, by its modules after the layers)."""
    for r in ranks:
        outcome, said, sharded = r["gemma3n"]
        assert outcome == "accepted" and sharded, outcome
        kept = [w for w in said if "model.layers.*.mlp is kept whole on every TP rank" in w]
        assert kept and "module model.layers.0.mlp.down_proj, its plan entry: 'rowwise'" in kept[0], said
        assert r["gemma3n_mlp_sharded"] is False and r["gemma3n_attn_sharded"] is True
        outcome, _, sharded = r["gemma3n_sp"]
        assert "sequence_parallel for model_type 'gemma3n_text'" in outcome and "\n" not in outcome, outcome
        assert not sharded


def test_a_wrong_user_plan_is_refused_on_a_skeleton(ranks):
    for r in ranks:
        outcome, _, sharded = r["olmo2_wrong"]
        assert "breaks model.layers.0.self_attn.q_norm" in outcome and "tiny float64 copy" in outcome, outcome
        assert not sharded


def test_an_inferred_plan_checks_every_block_on_the_copy(ranks):
    for r in ranks:
        outcome, said, sharded = r["bigcode"]
        assert outcome == "accepted" and sharded, outcome
        assert not [w for w in said if "not verified" in w or "not on the other blocks" in w], said


def test_custom_code_is_applied_unverified_with_the_reason(ranks):
    for r in ranks:
        outcome, said, sharded = r["custom"]
        assert outcome == "accepted" and sharded, outcome
        assert any("not verified" in w and "custom code" in w for w in said), said


def test_head_counts_of_the_copy_divide_by_tp():
    from hfpar.parallel.tensor_parallel.tiny_check import heads_for

    assert heads_for(2) == {}
    assert heads_for(4)["num_key_value_heads"] == 4 and "num_attention_heads" not in heads_for(4)
    assert all(v % 8 == 0 for v in heads_for(8).values()) and heads_for(8)["num_attention_heads"] == 8
