"""--attn_implementation hfpar_varlen (hfpar.train.varlen) and one-row padding-free batches (DataCollator one_row).

    python -m pytest -q -p no:cacheprovider tests/unit/test_varlen_attention.py

- a micro-batch in ONE row: the same samples, targets and loss as padded rows; packed rows concatenated keep their
  position ids and lose no target and gain none (each row's first label -100);
- every family of tests/helpers/tiny_configs.CONFIGS (tiny random-init models, float64) except Gemma2 (soft-capping:
  refused): the one-row batch through hfpar_varlen gives each sample's logits alone, and the loss and every
  parameter gradient of sdpa's block-diagonal mask over the same row (eager where transformers has no sdpa);
- refused in one line where it would compute something else (an attention mask, a KV cache, dropout, soft-capping),
  and by the preflight where its rows cannot be padding-free (--padding_free false, pp, classify, grpo);
- on CUDA (when the machine has one), torch's FlashAttention-2 varlen kernel in bf16 against sdpa.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar import data
from hfpar.config import parse_args
from hfpar.context import ParallelContext
from hfpar.data import IGNORE
from hfpar.preflight import feature_problems, model_problems
from hfpar.recipes import grpo
from hfpar.train import varlen
from tests.helpers.tiny_configs import CONFIGS

LENS = [9, 14, 5, 12, 7, 3]
SOFTCAP = ("gemma2",)  # its config soft-caps the attention logits
NO_DROPOUT = {"gpt2": {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}}  # train mode, compared exactly


def _samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in LENS]


def _one_row(samples, **kw) -> dict:
    return data.DataCollator(pad_token_id=0, padding_free=True, max_seq_length=20, one_row=True, **kw)(samples)


def _pair(model_type: str, ref_attn: str, **config):
    """(hfpar_varlen model, reference model) with the same float64 weights, in train mode."""
    varlen.register()
    cfg = {**CONFIGS[model_type][0], **config}
    models = []
    for attn in (varlen.NAME, ref_attn):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **cfg), attn_implementation=attn, experts_implementation="eager"
        )
        models.append(m.double().train())
    return models


# ------------------------------------------------------------------------------------------------ the rows
def test_one_row_holds_the_same_samples_targets_and_positions():
    samples = _samples()
    batch = _one_row(samples)
    assert batch["input_ids"].shape == (1, sum(LENS)) and "attention_mask" not in batch
    assert int(batch["token_mask"].sum()) == sum(LENS)
    cu = [0, *itertools.accumulate(LENS)]  # the samples' bounds, as transformers' flash kwargs
    assert batch["cu_seq_lens_q"].tolist() == cu and batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == batch["max_length_k"] == 14
    t = 0
    for s in samples:  # in order, whole, positions from 0, first label -100
        n = len(s["input_ids"])
        assert batch["input_ids"][0, t : t + n].tolist() == s["input_ids"]
        assert batch["position_ids"][0, t : t + n].tolist() == list(range(n))
        assert batch["labels"][0, t : t + n].tolist() == [IGNORE] + s["input_ids"][1:]
        t += n
    padded = _one_row(samples, pad_to_multiple_of=16)
    assert padded["input_ids"].shape == (1, 64) and int(padded["token_mask"].sum()) == sum(LENS)
    assert padded["cu_seq_lens_q"].tolist() == cu + list(range(51, 65))  # each pad token a sample of its own
    # rows packed already (--packing, clm): concatenated, positions kept, each row's first token no target
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "position_ids": [2, 3, 0, 1]},  # a clm row
        {"input_ids": [9, 10, 11], "labels": [IGNORE, 10, 11], "position_ids": [0, 1, 2]},
    ]
    joined = _one_row(rows)
    assert joined["position_ids"].tolist() == [[2, 3, 0, 1, 0, 1, 2]]
    assert joined["labels"].tolist() == [[IGNORE, 6, 7, 8, IGNORE, 10, 11]]
    with pytest.raises(data.DataError, match="padding_free=True"):
        data.DataCollator(pad_token_id=0, one_row=True)


def test_segments_start_at_rows_and_position_breaks():
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 0, 1]])
    cu, bounds = varlen.segments(pos)
    assert bounds == [0, 3, 5, 7, 8, 10] and cu.dtype == torch.int32 and cu.tolist() == bounds
    assert varlen.segments(pos)[0] is cu  # once per forward: every layer gets the same tensor
    pos[0, 1] = 5  # changed in place: computed again
    assert varlen.segments(pos)[1] == [0, 1, 2, 3, 5, 7, 8, 10]


def test_padding_free_mode_joins_packed_rows_for_attention_that_skips_masked_pairs():
    args = SimpleNamespace(padding_free=None, pp_size=1, attn_implementation=varlen.NAME)
    varlen.register()
    llama = AutoConfig.for_model("llama", **CONFIGS["llama"][0])
    assert data.padding_free_mode(args, "lm", llama, packed=True) == (True, None) and data.one_row(args)
    # a recipe whose collator builds rows of its own (dpo's pair rows) keeps them: they are not padding-free rows
    assert data.padding_free_mode(args, "lm", llama, packed=True, joins=False) == (False, None)
    sdpa = SimpleNamespace(padding_free=None, pp_size=1, attn_implementation="sdpa")
    assert data.padding_free_mode(sdpa, "lm", llama, packed=True) == (False, None) and not data.one_row(sdpa)


# ------------------------------------------------------------------------------------------- the attention
@pytest.mark.parametrize("model_type", [m for m in CONFIGS if m not in SOFTCAP])
def test_varlen_equals_the_block_diagonal_mask(model_type):
    """Loss, logits per sample and every parameter gradient: hfpar_varlen over one row == sdpa's (or eager's)
    block-diagonal mask over the same row, float64; each sample's logits == the sample alone."""
    ref_attn = "sdpa" if "sdpa" in CONFIGS[model_type][1] else "eager"
    fast, ref = _pair(model_type, ref_attn, **NO_DROPOUT.get(model_type, {}))
    batch = _one_row(_samples())
    inputs = {k: v for k, v in batch.items() if k != "token_mask"}  # + the samples' bounds as flash kwargs
    out_fast, out_ref = fast(**inputs, use_cache=False), ref(**inputs, use_cache=False)
    out_fast.loss.backward()
    out_ref.loss.backward()
    assert torch.allclose(out_fast.loss, out_ref.loss, rtol=1e-12, atol=0)
    assert (out_fast.logits - out_ref.logits).abs().max() <= 1e-10
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert (p.grad - q.grad).abs().max() <= 1e-10 * max(1.0, float(q.grad.abs().max())), name
    with torch.no_grad():
        t = 0
        for s in _samples():
            alone = ref(input_ids=torch.tensor([s["input_ids"]]), use_cache=False).logits[0]
            assert (out_fast.logits[0, t : t + len(alone)] - alone).abs().max() <= 1e-10
            t += len(alone)


def test_one_row_loss_equals_the_padded_batch_loss():
    """The trainer's view: the same tokens, the same targets, the same mean loss as padded rows with sdpa (to
    float32 round-off: transformers' loss function takes the logits in float32)."""
    fast, ref = _pair("llama", "sdpa")
    samples = _samples()
    padded = data.DataCollator(pad_token_id=0)(samples)
    row = _one_row(samples)
    a = ref(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], labels=padded["labels"]).loss
    b = fast(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"]).loss
    assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-6, atol=0), (a, b)


def _refusal(fn, *needles):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and varlen.NAME in msg and all(n in msg for n in needles), msg


def test_refused_where_it_would_compute_something_else():
    fast, _ = _pair("llama", "sdpa")
    row = _one_row(_samples())
    padded = data.DataCollator(pad_token_id=0)(_samples())
    _refusal(lambda: fast(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]), "attention mask")
    fast.eval()
    with torch.no_grad():
        cache = fast(input_ids=row["input_ids"][:, :5], use_cache=True).past_key_values
        _refusal(lambda: fast(input_ids=row["input_ids"][:, 5:6], past_key_values=cache, use_cache=True), "KV cache")
    dropout, _ = _pair("llama", "sdpa", attention_dropout=0.1)
    _refusal(lambda: dropout(input_ids=row["input_ids"], position_ids=row["position_ids"]), "dropout 0.1")
    three_d = row["position_ids"].expand(3, -1, -1)  # Qwen-VL-like multimodal positions (3, B, T): no sample marks
    q = torch.zeros(1, 4, 50, 8)
    attn = fast.model.layers[0].self_attn
    _refusal(lambda: varlen.varlen_attention_forward(attn, q, q, q, None, position_ids=three_d), "(3, 1, 50)")
    gemma2, _ = _pair("gemma2", "eager")
    _refusal(lambda: gemma2(input_ids=row["input_ids"], position_ids=row["position_ids"]), "softcap")


def test_preflight_refuses_rows_that_cannot_be_padding_free():
    ctx = ParallelContext(world=1)
    varlen_arg = ["--attn_implementation", varlen.NAME]
    for argv, recipe, task, needle in [
        ([*varlen_arg, "--padding_free", "false"], "sft", "lm", "--padding_free false"),
        ([*varlen_arg, "--pp_size", "2"], "sft", "lm", "--pp_size 2"),
        (varlen_arg, "classify", "classify", "classify"),
    ]:
        problems = [p for p in model_problems(parse_args(argv, recipe=recipe), ctx, task) if varlen.NAME in p]
        assert len(problems) == 1 and needle in problems[0] and "use sdpa" in problems[0], problems
    assert not [p for p in model_problems(parse_args(varlen_arg, recipe="sft"), ctx, "lm") if varlen.NAME in p]
    # what its forward refuses (Gemma2's soft-capping) is found on the tiny copy, before the model loads
    gemma2 = AutoConfig.for_model("gemma2", **CONFIGS["gemma2"][0])
    (capped,) = [p for p in model_problems(parse_args(varlen_arg, recipe="sft"), ctx, "lm", gemma2) if varlen.NAME in p]
    assert "softcap" in capped and capped.endswith("use sdpa") and "\n" not in capped, capped
    vlm = AutoConfig.from_pretrained(data.embedded_model_path(data.load.EMBEDDED_VLM))  # a vision encoder: both ways
    on_vlm = model_problems(parse_args(varlen_arg, recipe="sft"), ctx, "lm", vlm, image_text=True)
    assert any(varlen.NAME in p and "vision encoder attends both ways" in p for p in on_vlm), on_vlm
    cp = feature_problems(
        parse_args([*varlen_arg, "--cp_size", "2"], recipe="sft"), ParallelContext(world=2, cp=2), "lm"
    )
    assert any(varlen.NAME in p and "--cp_size 2" in p for p in cp), cp
    grpo_args = parse_args(varlen_arg, recipe="grpo", args_class=grpo.RECIPE.args_class)
    on_grpo = grpo.problems(grpo_args, ctx, None)
    assert any(varlen.NAME in p and "KV cache" in p for p in on_grpo), on_grpo


def _flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's documented semantics, written out (explicit softmax per sample):
    window_size (left, right), -1 unbounded, right 0 causal; query head h reads kv head h // (H / Hkv)."""
    assert cu_q is cu_k and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max()) and cu_q.dtype == torch.int32
    assert enable_gqa == (q.shape[1] != k.shape[1]), "GQA heads without enable_gqa (or enable_gqa without GQA)"
    out, (left, right) = torch.empty_like(q), window_size
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # (heads, n, D)
        ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for x in (ks, vs))
        i = torch.arange(e - s)
        ok = (i[None, :] <= i[:, None] + right) if right >= 0 else torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            ok &= i[None, :] >= i[:, None] - left
        scores = (qs @ ks.transpose(1, 2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        out[s:e] = (scores.masked_fill(~ok, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("gqa_arg", [True, False])  # torch 2.13's varlen_attn takes enable_gqa, 2.11's does not
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3_moe", "gpt2"])
def test_the_kernel_path_hands_the_kernel_what_it_expects(model_type, gqa_arg, monkeypatch):
    """The CUDA branch's glue on CPU (float64): layout, cu_seqlens, longest sample, GQA, the sliding window in
    flash's (left, right) convention, the scale: a written-out reference of varlen_attn's documented semantics in
    the kernel's place gives sdpa's block-diagonal loss and gradients."""
    monkeypatch.setattr(varlen, "_flash_applies", lambda q, v: True)
    monkeypatch.setattr(varlen, "_GQA_ARG", gqa_arg)
    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, **kw: calls.append(1) or _flash_reference(*a, **kw))
    fast, ref = _pair(model_type, "sdpa", **NO_DROPOUT.get(model_type, {}))
    row = _one_row(_samples())
    inputs = {k: v for k, v in row.items() if k != "token_mask"}
    a, b = fast(**inputs, use_cache=False), ref(**inputs, use_cache=False)
    a.loss.backward()
    b.loss.backward()
    assert len(calls) == fast.config.num_hidden_layers
    assert (a.logits - b.logits).abs().max() <= 1e-10
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max() <= 1e-10 * max(1.0, float(q.grad.abs().max())), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA only")
def test_flash_varlen_kernel_on_cuda_matches_sdpa_in_bf16():
    for model_type in ("llama", "mistral", "qwen3"):  # GQA; a sliding window shorter than the samples
        fast, ref = (m.to("cuda", torch.bfloat16) for m in _pair(model_type, "sdpa"))
        row = {k: v.cuda() for k, v in _one_row(_samples()).items() if k != "token_mask"}
        a, b = fast(**row).loss, ref(**row).loss
        a.backward()
        b.backward()
        assert abs(float(a) - float(b)) <= 2e-2 * abs(float(b)), (model_type, float(a), float(b))
        for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
            if q.grad is not None:
                rel = float((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12))
                assert rel <= 5e-2, (model_type, name, rel)
