"""hfpar_varlen in users' own code (hfpar.register_varlen_attention): transformers' padding-free collator
(DataCollatorWithFlattening) and the stock transformers.Trainer.

    python -m pytest -q -p no:cacheprovider tests/unit/test_varlen_own_code.py

- the flash kwargs that collator can add (cu_seq_lens_q, max_length_q) are what the kernel gets, with no search of
  the position ids (no host sync; traced whole under torch.compile);
- a Trainer run with hfpar_varlen trains like the same run with sdpa's block-diagonal mask (4 steps, float32).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

import hfpar
from hfpar.train import varlen
from tests.helpers.tiny_configs import CONFIGS
from tests.unit.test_varlen_attention import _flash_reference, _samples


def _model(attn: str, dtype=torch.float64):
    hfpar.register_varlen_attention()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mistral", **CONFIGS["mistral"][0])  # GQA and a sliding window of 5
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)


def test_flash_kwargs_from_the_batch_reach_the_kernel_unsearched(monkeypatch):
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_samples())
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append((cu_q, max_q))
        return _flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    def no_search(*a):
        raise AssertionError("the position ids were searched although the batch gave the samples")

    monkeypatch.setattr(varlen, "_flash_applies", lambda q, v: True)
    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    monkeypatch.setattr(varlen, "segments", no_search)
    fast, ref = _model(varlen.NAME), _model("sdpa")
    a = fast(**batch, use_cache=False)
    b = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False)
    assert len(seen) == 2 and all(cu is batch["cu_seq_lens_q"] and m == batch["max_length_q"] for cu, m in seen)
    assert (a.logits - b.logits).abs().max() <= 1e-10 and torch.allclose(a.loss, b.loss, rtol=1e-12, atol=0)
    monkeypatch.undo()  # the CPU path with the same kwargs: each sample's SDPA, bounds read from cu_seq_lens_q
    assert (_model(varlen.NAME)(**batch, use_cache=False).logits - b.logits).abs().max() <= 1e-10


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_trainer_with_the_flattening_collator_trains_like_sdpa(tmp_path, flash_kwargs):
    rows = Dataset.from_list([{"input_ids": s["input_ids"]} for s in _samples() * 4])
    losses = {}
    for attn in ("sdpa", varlen.NAME):
        args = TrainingArguments(
            output_dir=str(tmp_path / attn),
            per_device_train_batch_size=4,
            max_steps=4,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            data_seed=0,
        )
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs and attn == varlen.NAME)
        trainer = Trainer(model=_model(attn, torch.float32), args=args, train_dataset=rows, data_collator=collator)
        trainer.train()
        losses[attn] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses["sdpa"]) == 4 and losses["sdpa"][-1] < losses["sdpa"][0], losses  # it trains
    for x, y in zip(losses["sdpa"], losses[varlen.NAME]):
        assert abs(x - y) <= 1e-5 * abs(x), losses
