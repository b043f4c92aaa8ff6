"""LoRA on a tensor-parallel model, a representative subset of benchmarks/tensor_parallel/lora_sweep.py (every
causal-LM type): PEFT's LoRA ("all-linear", r 4) on TP=2 against LoRA on the unsplit model in a plain loop (loss and
every adapter's gradient, one SGD step, again; float64, within 1e-4), on 2 gloo ranks (one spawn).

    llama, gemma2      q / k / v / gate / up column-parallel (B split by rows, A's grad summed over TP), o / down
                       row-parallel (A split by columns, the adapter's partial sums before the all-reduce)
    phi3               packed qkv_proj / gate_up_proj: B split in W's packed parts
    gpt2               Conv1D layers (c_attn packed, c_proj, c_fc)
    falcon             fused query_key_value, a parallel attention + MLP block
    llama, gpt2 + SP   sequence parallelism: the adapters inside the regions see the gathered sequence
    qwen3_moe          MoE: all-linear reaches the router's and experts' weights (PEFT's target_parameters, resolved
                       before TP): the blocks stay the HF model's own, whole on every TP rank, the adapters PEFT's
    qwen2_moe          MoE: adapters on the shared expert and its gate only: the blocks become hfpar's MoE layers,
                       which call them as the HF modules they are
    roberta, deberta-v2, xlm, distilbert
                       classifiers (benchmarks/tensor_parallel/classify_sweep.py --lora, PEFT's SEQ_CLS: the head
                       trained whole, DistilBERT's pre_classifier with it): BERT-style regions whose out-projection
                       sits in a sibling module
Without the in-backward sum of the partial grads (A of a column-parallel layer, B of a row-parallel one) the first
step's B gradients of o / down differ by ~1 (measured).
"""

from __future__ import annotations

import pytest

from benchmarks.tensor_parallel.classify_sweep import lora_sweep_worker as classify_lora_worker
from benchmarks.tensor_parallel.lora_sweep import sweep_worker
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

EXACT = ("llama", "gemma2", "phi3", "gpt2", "falcon")
SP = ("llama", "gpt2")
CLASSIFIERS = ("roberta", "deberta-v2", "xlm", "distilbert")
MOE = {"qwen3_moe": True, "qwen2_moe": False}  # model type -> its blocks kept the HF model's own


def _worker(rank: int, world: int) -> dict:
    return {
        "tp": sweep_worker(rank, world, [*EXACT, *MOE]),
        "sp": sweep_worker(rank, world, list(SP), sp=True),
        "classify": classify_lora_worker(rank, world, list(CLASSIFIERS)),
    }


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_worker, 2)[0]


@pytest.mark.parametrize("model_type", EXACT)
def test_lora_on_tp_layers_matches_the_unsplit_model(results, model_type):
    r = results["tp"][model_type]
    assert r["status"] == "exact" and r["worst_rel"] < 1e-10, r
    assert r["split_adapters"] >= 4, f"{model_type}: adapters on TP layers {r['split_adapters']}"


@pytest.mark.parametrize("model_type", SP)
def test_lora_under_sequence_parallelism(results, model_type):
    r = results["sp"][model_type]
    assert r["status"] == "exact" and r["worst_rel"] < 1e-10, r


@pytest.mark.parametrize("model_type", MOE)
def test_lora_with_tp_on_a_moe_model_matches_the_unsplit_model(results, model_type):
    """Refused before this round (the recipe's TP path resolved only PEFT's Linear targets, missing the experts')."""
    r = results["tp"][model_type]
    assert r["status"] == "exact" and r["worst_rel"] < 1e-10 and r["hf_blocks"] is MOE[model_type], r
    assert r["split_adapters"] >= 4, r  # the attention's, split with their layers


@pytest.mark.parametrize("model_type", CLASSIFIERS)
def test_lora_on_tp_classifiers(results, model_type):
    r = results["classify"][model_type]
    assert r["status"] == "exact" and r["worst_rel"] < 1e-10 and r["blocks_sharded"], r
