"""HF semantics on tensor-parallel models: `model(..., labels=).loss`, one SGD step, generate(), the logit gather.

    python -m pytest tests/distributed/test_tp_hf_loss.py -q

One spawn of 2 gloo ranks runs every case in fp32 against a deepcopy of the unsharded model taken before
apply_tensor_parallel: the model's OWN loss from labels= (HF's ForCausalLMLoss on the reference, hfpar's
vocab-parallel cross-entropy on the shards), one SGD step on both, the loss again; written plans (Llama family,
Phi-3, Gemma, GPT-2 with Conv1D), BERT classification (head replicated: HF's loss untouched) and families whose
plan is derived from HF's base_model_tp_plan. The example script runs under torchrun against its 1-process run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from tests.helpers.dist import run_distributed, value_error_message
from tests.helpers.tp_models import DERIVED, batch, build, rel

ROOT = Path(__file__).resolve().parents[2]
WRITTEN = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2"]
CASES = [(mt, False) for mt in WRITTEN + DERIVED] + [("llama", True), ("qwen3", True), ("gpt2", True)]  # (type, SP)
TOL = 1e-4


def _step(model, loss, lr=0.5):
    from hfpar.parallel.tensor_parallel import sync_sequence_parallel_grads

    loss.backward()
    sync_sequence_parallel_grads(model)  # SP norms / q-k norms on local heads (no-op otherwise)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def _loss_step_case(case) -> dict:
    from hfpar.parallel.tensor_parallel import (
        VocabParallelCausalLMLoss,
        apply_tensor_parallel,
    )

    mt, sp = case
    model = build(mt)
    ref = copy.deepcopy(model)
    ids, mask, labels = batch()
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    res = {"ours": isinstance(model.loss_function, VocabParallelCausalLMLoss)}
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss  # HF's ForCausalLMLoss
    res["logits_v"] = out.logits.shape[-1]
    res["before"] = (out.loss.item(), ref_loss.item())
    _step(model, out.loss)
    _step(ref, ref_loss)
    res["after"] = (
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.item(),
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.item(),
    )
    return res


def _kwargs_cases() -> dict:
    """num_items_in_batch, shift_labels=, all-masked rows, the gather helper, a labels-aware custom forward."""
    from hfpar.parallel.tensor_parallel import (
        apply_tensor_parallel,
        gather_vocab_logits,
    )

    model = build("llama")
    ref = copy.deepcopy(model)
    ids, mask, labels = batch()
    apply_tensor_parallel(model, dist.group.WORLD)
    res = {}
    n = torch.tensor(23)  # e.g. the global batch's target count
    res["num_items"] = (
        model(input_ids=ids, labels=labels, num_items_in_batch=n).loss.item(),
        ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss.item(),
        ref(input_ids=ids, labels=labels).loss.item(),
    )
    shift = torch.roll(labels, 2, dims=1)  # anything: taken as is, not shifted again
    res["shift_labels"] = (
        model(input_ids=ids, labels=labels, shift_labels=shift).loss.item(),
        ref(input_ids=ids, labels=labels, shift_labels=shift).loss.item(),
    )
    logits = model(input_ids=ids, attention_mask=mask).logits
    full = gather_vocab_logits(logits, dist.group.WORLD)
    res["gather"] = (
        tuple(logits.shape),
        tuple(full.shape),
        rel(full.detach(), ref(input_ids=ids, attention_mask=mask).logits.detach()),
    )
    torch.manual_seed(0)
    manual = ManualLossLlama(copy.deepcopy(ref.config))
    apply_tensor_parallel(manual, dist.group.WORLD)
    res["err_manual"] = value_error_message(lambda: manual(input_ids=ids, labels=labels))
    return res


class ManualLossLlama(LlamaForCausalLM):
    """A forward that computes its loss itself (not through self.loss_function): on shards that is wrong."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        v = out.logits.shape[-1]  # (vocab shards: the ids wrapped to fit)
        out.loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten() % v)
        return out


def _generate_cases() -> dict:
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    res = {}
    for mt in ("llama", "gpt2"):
        model = build(mt).eval()
        ref = copy.deepcopy(model)
        prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(7))
        apply_tensor_parallel(model, dist.group.WORLD)
        kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(prompt)}
        res[mt] = (
            model.generate(prompt, **kw).tolist(),
            ref.generate(prompt, **kw).tolist(),
            model(input_ids=prompt).logits.shape[-1],
        )  # the shards are back after generate()
    sp = apply_tensor_parallel(build("llama").eval(), dist.group.WORLD, sequence_parallel=True)
    res["err_sp"] = value_error_message(lambda: sp.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2))
    return res


def _bert_case() -> dict:
    from transformers import AutoModelForSequenceClassification, BertConfig

    from hfpar.parallel.tensor_parallel import (
        VocabParallelCausalLMLoss,
        apply_tensor_parallel,
    )

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa").train()
    ref = copy.deepcopy(model)
    ids, mask, _ = batch()
    y = torch.tensor([0, 2])
    apply_tensor_parallel(model, dist.group.WORLD)
    res = {"ours": isinstance(model.loss_function, VocabParallelCausalLMLoss)}
    out = model(input_ids=ids, attention_mask=mask, labels=y)
    ref_out = ref(input_ids=ids, attention_mask=mask, labels=y)
    res["before"] = (out.loss.item(), ref_out.loss.item())
    _step(model, out.loss)
    _step(ref, ref_out.loss)
    res["after"] = (
        model(input_ids=ids, attention_mask=mask, labels=y).loss.item(),
        ref(input_ids=ids, attention_mask=mask, labels=y).loss.item(),
    )
    return res


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {
        "loss": {c: _loss_step_case(c) for c in CASES},
        "kwargs": _kwargs_cases(),
        "bert": _bert_case(),
        "generate": _generate_cases(),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'sp' if c[1] else 'tp'}")
def test_model_loss_and_one_step(ranks, case):
    for res in ranks:
        r = res["loss"][case]
        assert r["ours"] and r["logits_v"] == 64  # vocab shards kept
        assert rel(*r["before"]) < TOL, r["before"]
        assert rel(*r["after"]) < TOL, r["after"]
        assert abs(r["after"][1] - r["before"][1]) > 1e-2, r  # the step changed the loss
    assert ranks[0]["loss"][case] == ranks[1]["loss"][case]  # same numbers on both ranks


def test_num_items_in_batch_and_shift_labels(ranks):
    for res in ranks:
        got, want, mean = res["kwargs"]["num_items"]
        assert rel(got, want) < TOL and abs(want - mean) > 1e-2, (got, want, mean)  # sum / 23, not the mean
        assert rel(*res["kwargs"]["shift_labels"]) < TOL, res["kwargs"]["shift_labels"]


def test_gather_vocab_logits(ranks):
    shard, full, err = ranks[0]["kwargs"]["gather"]
    assert shard == (2, 8, 64) and full == (2, 8, 128) and err < TOL, (shard, full, err)


def test_loss_computed_outside_loss_function_is_refused(ranks):
    assert "computed its loss without self.loss_function" in ranks[0]["kwargs"]["err_manual"]


def test_bert_classification_keeps_hf_loss(ranks):
    for res in ranks:
        r = res["bert"]
        assert not r["ours"]
        assert rel(*r["before"]) < TOL and rel(*r["after"]) < TOL, r
        assert abs(r["after"][1] - r["before"][1]) > 1e-3, r


@pytest.mark.parametrize("mt", ["llama", "gpt2"])
def test_generate_greedy_matches_unsharded(ranks, mt):
    for res in ranks:
        got, want, v_after = res["generate"][mt]
        assert got == want, (got, want)
        assert len(got[0]) == 5 + 8 and v_after == 64


def test_generate_refused_under_sequence_parallel(ranks):
    assert "sequence_parallel=True: generate()" in ranks[0]["generate"]["err_sp"], ranks[0]["generate"]["err_sp"]
