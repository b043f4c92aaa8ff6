"""The rollout samples what TRL 1.16 GRPOTrainer samples from, and scores it at the same temperature:

- the generation settings are TRL's own GenerationConfig, completed by the checkpoint's generation_config where TRL
  leaves a value unset: the checkpoint's repetition_penalty, top_k and temperature do not apply, its
  no_repeat_ngram_size does; the processed scores of the first decoding step equal those of transformers' generate
  with TRL's config, and the model object may lack the checkpoint's generation_config (hfpar's sharded loading
  builds it from config.json): it is read from the directory;
- every EOS id of the checkpoint's generation_config (plus the tokenizer's) stops, cuts and terminates a completion:
  TRL's `eos_token_ids`; a completion ending in the pad token is not truncated (TRL's rule);
- the chunked log-probs and entropies at a temperature are those of softmax(logits / T), gradients included.

    python -m pytest -q tests/unit/test_grpo_trl_generation.py
"""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from benchmarks.dpo.trl_compare import _reset_accelerate
from benchmarks.grpo.trl_compare import letter_share, make_case
from hfpar.parallel.chunked_logps import chunked_token_logps
from hfpar.rollout import sampling
from hfpar.rollout.engine import (
    GenerationConfig as RolloutGeneration,
)
from hfpar.rollout.engine import (
    InPlaceEngine,
    checkpoint_generation_config,
    eos_token_ids,
    truncated,
)
from hfpar.rollout.sampling import row_key

pytest.importorskip("trl")
TEMPERATURE = 0.7
# what a chat checkpoint ships (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, temperature 0.7): TRL sets
# these explicitly; no_repeat_ngram_size it leaves unset, so the checkpoint's applies in both
SHIPPED = {"repetition_penalty": 1.5, "top_k": 5, "temperature": 0.3, "no_repeat_ngram_size": 2, "do_sample": True}


class _FirstScores(sampling.RowGumbelNoise):
    """Keeps the first decoding step's scores as they reach the noise (processed and warped)."""

    first: list = []

    def __call__(self, input_ids, scores):
        if not _FirstScores.first:
            _FirstScores.first.append(scores.clone())
        return super().__call__(input_ids, scores)


def _engine(model_dir: str, model, tok) -> InPlaceEngine:
    """The recipe's engine settings (hfpar.recipes.grpo.objective)."""
    checkpoint = checkpoint_generation_config(model_dir, model)
    return InPlaceEngine(
        RolloutGeneration(
            max_new_tokens=6,
            temperature=TEMPERATURE,
            eos_token_id=eos_token_ids(checkpoint, tok.eos_token_id),
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            checkpoint=checkpoint,
        )
    )


def _generate(engine, model, prompts, keys, monkeypatch):
    backend = types.SimpleNamespace(model=model, acc=types.SimpleNamespace(device=torch.device("cpu")))
    backend.autocast = contextlib.nullcontext
    _FirstScores.first = []
    monkeypatch.setattr(sampling, "RowGumbelNoise", _FirstScores)
    return engine.generate(backend, prompts, keys), _FirstScores.first[0]


def _trl_trainer(model_dir: str, data_file: str, out: str):
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer

    _reset_accelerate()
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        temperature=TEMPERATURE,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
    ds = load_dataset("json", data_files=data_file)["train"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    return GRPOTrainer(model=model_dir, reward_funcs=[letter_share], args=args, train_dataset=ds, processing_class=tok)


def test_generation_is_trls(tmp_path, monkeypatch):
    model_dir, data_file = make_case(tmp_path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    GenerationConfig(**SHIPPED, eos_token_id=tok.eos_token_id).save_pretrained(model_dir)
    # as hfpar's sharded loading has it: the weights, and a generation_config derived from config.json alone
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    prompts = [tok("repeat a a a 3")["input_ids"], tok("repeat b 2")["input_ids"]]
    keys = [row_key(42, 0, 0, 0), row_key(42, 0, 1, 0)]
    first, _ = _generate(_engine(model_dir, model, tok), model, prompts, keys, monkeypatch)
    # the checkpoint declares row 0's second token an EOS too (an end-of-turn id): it stops row 0 there
    stop = first[0][1]
    GenerationConfig(**SHIPPED, eos_token_id=[tok.eos_token_id, stop]).save_pretrained(model_dir)
    engine = _engine(model_dir, model, tok)
    rows, ours = _generate(engine, model, prompts, keys, monkeypatch)

    trainer = _trl_trainer(model_dir, data_file, str(tmp_path / "trl"))
    try:
        assert engine.config.eos_ids == trainer.eos_token_ids == [tok.eos_token_id, stop]
        ids = torch.full((2, max(map(len, prompts))), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left-padded, as both generate
            ids[r, ids.shape[1] - len(p) :], mask[r, ids.shape[1] - len(p) :] = torch.tensor(p), 1
        with torch.no_grad():
            out = trainer.model.eval().generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=trainer.generation_config,
                output_scores=True,
                return_dict_in_generate=True,
            )
            # the checkpoint's own settings (what hfpar sampled with before): other scores, so the check can fail
            shipped = trainer.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=GenerationConfig(**SHIPPED, max_new_tokens=1, pad_token_id=tok.pad_token_id),
                output_scores=True,
                return_dict_in_generate=True,
            ).scores[0]
    finally:
        _reset_accelerate()
    theirs = out.scores[0]  # the first step's scores after TRL's processors and warpers
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)], rtol=1e-6, atol=1e-6)
    assert not torch.equal(torch.isinf(shipped), torch.isinf(theirs))
    assert rows[0] == first[0][:2] and not truncated(rows[0], engine.config.eos_ids, tok.pad_token_id)


def test_truncation_rule_is_trls():
    eos, pad = [2, 7], 0
    assert not truncated([5, 7], eos, pad) and not truncated([5, 2], eos, pad)
    assert not truncated([5, 0], eos, pad)  # ends in the pad token: not truncated (TRL's eos_and_pad)
    assert truncated([5, 6], eos, pad)


def test_checkpoint_without_generation_config(tmp_path):
    """No generation_config.json: the one transformers derives from config.json, as from_pretrained gives TRL."""
    model_dir, _ = make_case(tmp_path)
    Path(model_dir, "generation_config.json").unlink(missing_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    got = checkpoint_generation_config(model_dir, model)
    assert got.eos_token_id == model.generation_config.eos_token_id
    assert json.loads(got.to_json_string()).get("repetition_penalty") is None


@pytest.mark.parametrize("chunk", [3, 16])
def test_chunked_logps_at_a_temperature(chunk):
    torch.manual_seed(0)
    n, h, v = 10, 8, 13
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (n,))
    t[3] = -100
    c = torch.randn(n, dtype=torch.float64)

    def grads(lp):  # a non-linear loss of the log-probs, as the policy loss is
        (torch.exp(lp) * c).sum().backward()
        out = [g.grad.clone() for g in (x, w, b)]
        for g in (x, w, b):
            g.grad = None
        return out

    lp, ent = chunked_token_logps(x, w, b, t, chunk=chunk, temperature=TEMPERATURE)
    z = F.linear(x, w, b) / TEMPERATURE
    ref = z.log_softmax(-1).gather(1, t.clamp(min=0)[:, None]).squeeze(1) * (t != -100)
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    assert torch.allclose(lp, ref, atol=1e-12) and torch.allclose(ent, ref_ent.detach(), atol=1e-12)
    for a, r in zip(grads(lp), grads(ref)):
        assert torch.allclose(a, r, atol=1e-12)
