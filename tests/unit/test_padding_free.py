"""Padding-free batches (the sft recipe's default): each micro-batch's samples packed into rows of at most
--max_seq_length tokens, kept apart by their position ids. Same samples, same targets, same loss as padded rows.

    python -m pytest -q -p no:cacheprovider tests/unit/test_padding_free.py

- the packing itself (first-fit decreasing, layout, targets, errors) and when it applies (hfpar.data.padding_free);
- no token attends across samples, in every family the default allows (tiny random-init models, float64, eager
  and sdpa; sliding windows shorter than the samples): each sample's logits in a padding-free batch equal its
  logits alone, and changing one sample changes no other sample's logits;
- MoE routers count real tokens only (BatchPlan's scope, also through activation checkpointing's recompute):
  the padding-free batch gives the padded batch's loss and grads;
- the recipe (one process): --padding_free false reproduces the default run's per-step loss, grad norm,
  target tokens and real tokens.
The parity suites run the default against the (padding-free) single-process run and assert run_info.json's
padding_free: tests/launch/test_backends_parity.py (DDP, FSDP2, ZeRO-1/2/3), tests/launch/test_tp_parity.py (TP=2 alone,
with SP, x DDP / FSDP2 / ZeRO-2), tests/launch/test_cp_parity.py; tests/launch/test_ep_parity.py runs it too, and
tests/launch/test_pp_parity.py holds the pipeline's padded batches (it falls back) to the padding-free single run.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar import data
from hfpar.config import parse_args
from hfpar.context import ParallelContext
from hfpar.data import IGNORE, DataError
from hfpar.data.collate import first_fit_decreasing, greedy_bins
from hfpar.data.packing_probe import packing_problem
from hfpar.parallel.context_parallel import shift_labels
from hfpar.parallel.expert_parallel import (
    apply_expert_parallel,
    attach_moe_token_mask,
    set_aux_loss_grad_scale,
    upcycle_to_moe,
)
from hfpar.parallel.expert_parallel.router import current_token_mask
from hfpar.preflight import model_problems
from hfpar.train.batch_plan import BatchPlan
from hfpar.train.losses import shifted_lm_loss_sum
from tests.helpers.tiny_configs import CONFIGS

LENS, CAP = [9, 14, 5, 12, 7, 3], 20  # 3 rows of <= 20 tokens (50 tokens: 3 is the fewest)


# ------------------------------------------------------------------------------------------------ packing
def test_first_fit_decreasing_fills_few_rows_deterministically():
    assert first_fit_decreasing(LENS, CAP) == [[1, 2], [3, 4], [0, 5]]  # 14+5, 12+7, 9+3
    assert first_fit_decreasing([25, 3, 3], 20) == [[0], [1, 2]]  # too long: a row of its own
    assert first_fit_decreasing([4, 4, 4], 8) == [[0, 1], [2]]  # ties keep their order
    assert greedy_bins(LENS, CAP) == [[0], [1, 2], [3, 4], [5]]  # pack(): in order, 4 rows


@pytest.fixture(scope="module")
def sft():
    tok = data.load_tokenizer(None)
    ds, _ = data.tokenize_sft(data.load_splits(None, "sft")["train"].select(range(16)), tok, 128)
    return tok, [ds[i] for i in range(16)]


def _segments(batch):
    """(row, start, length) of every sample in a padding-free batch, from its position ids and token mask."""
    out = []
    for r, (pos, real) in enumerate(zip(batch["position_ids"].tolist(), batch["token_mask"].tolist())):
        for t, (p, m) in enumerate(zip(pos, real)):
            if m and p == 0:
                out.append([r, t, 1])
            elif m:
                out[-1][2] += 1
    return out


def test_padding_free_batch_holds_the_same_samples_and_targets(sft):
    tok, feats = sft
    padded = data.DataCollator(tok, pad_to_multiple_of=4)(feats)
    free = data.DataCollator(tok, pad_to_multiple_of=4, padding_free=True, max_seq_length=128)(feats)
    assert set(free) == {"input_ids", "labels", "position_ids", "token_mask"}
    rows, length = free["input_ids"].shape
    assert rows < len(feats) // 2 and length % 4 == 0 and length <= 128
    assert (
        int(free["token_mask"].sum()) == int(padded["attention_mask"].sum()) == sum(len(f["input_ids"]) for f in feats)
    )
    found = {}
    for r, t, n in _segments(free):
        assert free["position_ids"][r, t : t + n].tolist() == list(range(n))
        found[tuple(free["input_ids"][r, t : t + n].tolist())] = free["labels"][r, t : t + n].tolist()
    assert len(found) == len(feats)
    for f in feats:  # each sample once, whole; its first label -100 (never a target in padded rows either)
        assert found[tuple(f["input_ids"])] == [IGNORE] + f["labels"][1:]
    targets = [shift_labels(b)["labels"] for b in (padded, free)]  # what the trainer's loss sees
    assert int((targets[0] != IGNORE).sum()) == int((targets[1] != IGNORE).sum()) > 0
    assert sorted(targets[0][targets[0] != IGNORE].tolist()) == sorted(targets[1][targets[1] != IGNORE].tolist())
    packed = data.pack(data.tokenize_sft(data.load_splits(None, "sft")["train"].select(range(6)), tok, 64)[0], 64)
    rows = [packed[i] for i in range(len(packed))]  # already packed: left as they are
    a, b = data.DataCollator(tok)(rows), data.DataCollator(tok, padding_free=True, max_seq_length=64)(rows)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_collator_refuses_padding_free_where_it_cannot_apply(sft):
    tok, _ = sft
    for kwargs, needles in [
        ({"task": "classify", "padding_free": True, "max_seq_length": 64}, ("'classify'", "lm")),
        ({"padding_free": True}, ("max_seq_length", "None", ">= 2")),
    ]:
        with pytest.raises(DataError) as e:
            data.DataCollator(tok, **kwargs)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def _args(**kw):
    return SimpleNamespace(**{"padding_free": None, "pp_size": 1, "attn_implementation": None, **kw})


def _cfg(model_type: str):
    return AutoConfig.for_model(model_type, **CONFIGS.get(model_type, ({}, ()))[0])


def test_padding_free_mode_says_where_it_applies():
    mode = data.padding_free_mode
    assert mode(_args(), "lm", _cfg("llama"), packed=False) == (True, None)
    flash = _args(padding_free=True, attn_implementation="flash_attention_2")
    assert mode(flash, "lm", _cfg("qwen3"), packed=False) == (True, None)
    assert mode(_args(padding_free=False), "lm", _cfg("llama"), packed=False) == (False, None)
    assert mode(_args(), "lm", _cfg("llama"), packed=True) == (False, None)  # --packing, clm: rows packed already
    for args, task, model_type, needles in [
        (_args(), "classify", "llama", ["classify"]),
        (_args(pp_size=2), "lm", "llama", ["--pp_size 2", "--pp_microbatches"]),
        (_args(), "lm", "opt", ["'opt'", "packed samples see each other"]),
        (_args(), "lm", "t5", ["'t5'", "could not be checked"]),  # an encoder-decoder: no causal-LM class
        (_args(attn_implementation="paged|sdpa"), "lm", "llama", ["paged|sdpa", "sdpa", "eager", "flex_attention"]),
    ]:
        on, why = mode(args, task, _cfg(model_type), packed=False)
        assert not on and "\n" not in why and all(n in why for n in needles), why


def test_explicit_padding_free_is_refused_by_the_preflight_where_it_cannot_apply():
    ctx = ParallelContext(world=1)
    for argv, recipe, task, refused in [
        (["--padding_free"], "classify", "classify", True),
        ([], "classify", "classify", False),
        (["--padding_free", "true", "--packing"], "sft", "lm", False),
        (["--padding_free", "true"], "sft", "lm", False),
    ]:
        problems = model_problems(parse_args(argv, recipe=recipe), ctx, task)
        lines = [p for p in problems if p.startswith("--padding_free true: ")]
        assert len(lines) == int(refused), problems
        assert not refused or "classify keeps padded batches; drop the option" in lines[0]


# ---------------------------------------------------------------------------- no attention across samples
def _tiny(model_type: str, attn: str, config: dict | None = None):
    cfg = AutoConfig.for_model(model_type, **(config or CONFIGS[model_type][0]))
    torch.manual_seed(0)
    return (
        AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, experts_implementation="eager").double().eval()
    )


def _samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in LENS]


def _per_sample_logits(model, samples) -> list[torch.Tensor]:
    """Each sample's logits, read from ONE padding-free batch of all of them (3 rows, laid out as FFD places them)."""
    batch = data.DataCollator(pad_token_id=0, padding_free=True, max_seq_length=CAP)(samples)
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 3
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    out = [None] * len(samples)
    for r, row in enumerate(first_fit_decreasing(LENS, CAP)):
        t = 0
        for i in row:
            assert batch["input_ids"][r, t : t + LENS[i]].tolist() == samples[i]["input_ids"]
            out[i] = logits[r, t : t + LENS[i]]
            t += LENS[i]
    return out


def _leak(model, samples) -> float:
    """Largest difference between a sample's logits in the padding-free batch and its logits alone."""
    got = _per_sample_logits(model, samples)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]]), use_cache=False).logits[0] for s in samples]
    return max(float((g - a).abs().max()) for g, a in zip(got, alone))


@pytest.mark.parametrize("model_type,attn", [(m, a) for m, (_, attns) in CONFIGS.items() for a in attns])
def test_no_token_attends_across_samples(model_type, attn):
    model = _tiny(model_type, attn)
    samples = _samples()
    # eager attention takes its softmax in float32 (transformers), hence 1e-7 there rather than 1e-15
    assert _leak(model, samples) <= 1e-5
    base = _per_sample_logits(model, samples)
    changed = [dict(s) for s in samples]
    changed[1] = {"input_ids": [(t * 7 + 3) % 63 + 1 for t in samples[1]["input_ids"]]}  # shares row 0 with sample 2
    after = _per_sample_logits(model, changed)
    assert float((after[1] - base[1]).abs().max()) > 1e-3  # the changed sample itself does change
    assert max(float((a - b).abs().max()) for i, (a, b) in enumerate(zip(after, base)) if i != 1) <= 1e-12


def test_a_family_the_check_refuses_does_mix_samples():
    """OPT builds its mask without the position ids: packed rows leak, which is why the model's code is checked."""
    opt = {
        "hidden_size": 32,
        "ffn_dim": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 32,
        "use_cache": False,
    }
    assert _leak(_tiny("opt", "sdpa", opt), _samples()) > 1e-2
    assert "packed samples see each other" in packing_problem(AutoConfig.for_model("opt", **opt), "sdpa")


def test_moe_routers_see_real_tokens_only():
    """An upcycled MoE (aux loss on): the padding-free batch through BatchPlan gives the padded batch's loss and
    grads (router statistics over real tokens in both, also when activation checkpointing recomputes the MoE layers
    in backward); without the token mask its row padding would count."""
    samples = [{"input_ids": s["input_ids"]} for s in _samples(1)]
    plan = BatchPlan("lm", ParallelContext(world=1))
    padded, free = (
        data.DataCollator(pad_token_id=0),
        data.DataCollator(pad_token_id=0, padding_free=True, max_seq_length=CAP),
    )
    set_aux_loss_grad_scale(1.0)

    def run(collator, publish: bool = True, checkpointing: bool = False):
        model = _tiny("llama", "sdpa")
        upcycle_to_moe(model, 4, 2, aux_loss_coef=0.1, seed=0)
        apply_expert_parallel(model)
        attach_moe_token_mask(model)  # padded rows: the attention_mask in forward, as the recipe does
        if checkpointing:
            model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        raw = collator(samples)
        batch, scope = plan(raw)
        assert "token_mask" not in batch
        with scope if publish else contextlib.nullcontext():
            if "token_mask" in raw and publish:
                assert torch.equal(current_token_mask(), raw["token_mask"])
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
            loss, _ = shifted_lm_loss_sum(logits, batch["labels"])
            loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])

    (loss_p, grad_p), (loss_f, grad_f) = run(padded), run(free)
    for collator in (padded, free):
        _, grad = run(collator, checkpointing=True)
        assert float((grad - grad_f).norm()) <= 1e-8 * float(grad_f.norm())
    _, grad_unmasked = run(free, publish=False)  # the row padding counted by the routers: the aux gradient moves
    # measured: loss equal, grads 1.1e-10 apart (the router computes in float32); 6.8e-4 apart unmasked
    assert abs(loss_p - loss_f) <= 1e-10 * abs(loss_p)
    assert float((grad_p - grad_f).norm()) <= 1e-8 * float(grad_p.norm())
    assert float((grad_unmasked - grad_f).norm()) > 1e-5 * float(grad_f.norm())
