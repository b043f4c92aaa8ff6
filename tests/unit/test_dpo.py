"""The dpo recipe's pieces against TRL 1.16's own code, without training: the loss formulas and metrics (TRL's
DPOTrainer._compute_loss run on made-up log-probs), the tokenization (TRL's _prepare_dataset), the truncation
(TRL's DataCollatorForPreference), the pair rows and their labels, and the one-line refusals of bad data."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from hfpar.data import DataError, load_tokenizer
from hfpar.data.preference import (
    PairCollator,
    decode_targets,
    extract_prompt,
    make_preference,
    tokenize_pair,
    tokenize_preference,
    truncate_pair,
    with_attention_mask,
)
from hfpar.objectives.preference import LOSS_TYPES, pair_losses

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _trl_loss(loss_type, beta, ls, logps, ref, comp_mask):
    """TRL's _compute_loss on a fake model whose per-token log-probs are `logps` (2P, T-1)."""
    P = logps.shape[0] // 2
    outputs = SimpleNamespace(
        log_probs=logps,
        entropy=torch.zeros_like(logps),
        mean_logits=torch.zeros_like(logps),
        is_top1=torch.zeros_like(logps, dtype=torch.bool),
    )
    acc = SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=acc,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=ls,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(),
    )
    inputs = {
        "input_ids": torch.zeros(2 * P, logps.shape[1] + 1, dtype=torch.long),
        "completion_mask": comp_mask,
        "attention_mask": torch.ones_like(comp_mask),
        "ref_chosen_logps": ref[:, 0],
        "ref_rejected_logps": ref[:, 1],
    }
    loss = trl_dpo.DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, False)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_losses_and_metrics_equal_trl(loss_type):
    g = torch.Generator().manual_seed(0)
    P, T = 5, 12
    comp = (torch.rand(2 * P, T, generator=g) > 0.4).long()
    comp[:, 0] = 0
    per_tok = -torch.rand(2 * P, T - 1, generator=g, dtype=torch.float64) * 3 * comp[:, 1:]
    ref = -torch.rand(P, 2, generator=g, dtype=torch.float64) * 20
    ls = 0.1 if loss_type == "robust" else 0.0
    want, metrics = _trl_loss(loss_type, 0.3, ls, per_tok, ref, comp)
    seq = per_tok.sum(1)
    logps = torch.stack(seq.chunk(2), dim=-1)  # (P, 2)
    lengths = torch.stack(comp.sum(1).double().chunk(2), dim=-1)  # (P, 2) TRL counts the unshifted mask
    got = pair_losses(loss_type, 0.3, ls, logps, ref, lengths).mean()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    r = 0.3 * (logps - ref)
    assert metrics["rewards/chosen"] == pytest.approx(float(r[:, 0].mean()), rel=1e-12)
    assert metrics["rewards/accuracies"] == pytest.approx(float((r[:, 0] > r[:, 1]).double().mean()))
    assert metrics["logps/rejected"] == pytest.approx(float(logps[:, 1].mean()), rel=1e-12)


def _trl_tokenized(rows, tok, max_length=None):
    fake = SimpleNamespace(_tokenizer=tok)
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    return trl_dpo.DPOTrainer._prepare_dataset(fake, Dataset.from_list(rows), tok, args, "train").to_list()


def test_tokenization_equals_trl_for_every_format(tok):
    conv = make_preference(3, n_train=6, n_eval=1)["train"].to_list()
    standard = [
        {"prompt": "count 3 to 5\n", "chosen": "3 4 5", "rejected": "3 4"},
        {"prompt": "repeat k 2\n", "chosen": "kk", "rejected": "kkk"},
    ]
    implicit = [
        {"chosen": "say hi: hello there", "rejected": "say hi: bye"},
        {
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}],
        },
    ]
    for rows in (conv, standard, implicit[:1], implicit[1:]):
        want = _trl_tokenized(rows, tok)
        got = [tokenize_pair(dict(r), tok, i) for i, r in enumerate(rows)]
        assert [{k: w[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for w in want] == got
    assert extract_prompt(implicit[0]) == {"prompt": "say hi:", "chosen": " hello there", "rejected": " bye"}


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_equals_trl_collator(tok, mode):
    rows = make_preference(3, n_train=4, n_eval=1)["train"].to_list()
    pairs = [tokenize_pair(dict(r), tok, i) for i, r in enumerate(rows)]
    want = trl_dpo.DataCollatorForPreference(pad_token_id=0, max_length=20, truncation_mode=mode)(pairs)
    for i, p in enumerate(pairs):
        got = truncate_pair(p, max_length=20, truncation_mode=mode)
        for side, row in (("chosen", i), ("rejected", i + len(pairs))):
            ids, mask = got[side]
            n = int(want["attention_mask"][row].sum())
            assert want["input_ids"][row, :n].tolist() == ids and want["completion_mask"][row, :n].tolist() == mask


def test_pair_rows_hold_both_sequences_with_their_targets(tok):
    pairs, _ = tokenize_preference(make_preference(3, n_train=3, n_eval=1)["train"], tok, 128)
    batch = PairCollator(tok, pad_to_multiple_of=8)([pairs[i] for i in range(3)])
    assert batch["input_ids"].shape[1] % 8 == 0
    token, seq, valid = decode_targets(batch["labels"])
    for b in range(3):
        p = pairs[b]
        lc = len(p["prompt_ids"]) + len(p["chosen_ids"])
        assert batch["position_ids"][b, lc] == 0  # the rejected sequence restarts
        assert set(seq[b][valid[b]].tolist()) == {2 * b, 2 * b + 1}
        chosen = token[b][valid[b] & (seq[b] == 2 * b)].tolist()
        assert chosen == p["chosen_ids"]  # every completion token is a target


def test_shared_prompt_rows_give_the_plain_rows_log_probs(tok):
    """share_prompt: [prompt + chosen | last prompt token + rejected] under its (B, 1, T, T) mask gives every
    sequence's log-prob of the plain layout (float64, sdpa) with fewer tokens; where keep_end truncation left the
    two prompts different, that pair is the plain one; pairs of unequal lengths share rows (packed), each seeing
    only itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar.data.load import embedded_model_path
    from hfpar.parallel.context_parallel import shift_labels

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(embedded_model_path()), dtype=torch.float64, attn_implementation="sdpa"
    )
    pairs, _ = tokenize_preference(make_preference(3, n_train=6, n_eval=1)["train"], tok, 128)
    feats = [pairs[i] for i in range(6)]

    def logps(share, mode, max_length):
        batch = shift_labels(
            with_attention_mask(
                PairCollator(tok, share_prompt=share, max_length=max_length, truncation_mode=mode)(feats)
            )
        )
        rows.append(batch["input_ids"].shape[0])
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
        with torch.no_grad():
            lp = torch.log_softmax(model(**inputs).logits, -1)
        token, seq, valid = decode_targets(batch["labels"])
        lp = lp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        return torch.zeros(12, dtype=lp.dtype).index_add(0, seq[valid], lp[valid]), int(batch["token_mask"].sum())

    for mode, max_length in (("keep_start", 40), ("keep_end", 40), ("keep_start", 128)):
        rows = []
        (plain, n_plain), (shared, n_shared) = logps(False, mode, max_length), logps(True, mode, max_length)
        torch.testing.assert_close(shared, plain, rtol=1e-12, atol=1e-12)
        assert n_shared < n_plain if mode == "keep_start" else n_shared <= n_plain
        assert rows[0] == 6 and (rows[1] < 6 if max_length == 128 else rows[1] <= 6)  # 128: lengths differ, packed


def test_bad_preference_data_refused_naming_the_example(tok):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    conv = {
        "prompt": [{"role": "user", "content": "a"}],
        "chosen": [{"role": "assistant", "content": "b"}],
        "rejected": [{"role": "assistant", "content": "c"}],
    }
    cases = [
        ([good, {"prompt": "a", "chosen": "", "rejected": "c"}], "preference example 1: empty or missing 'chosen'"),
        ([{"prompt": "a", "chosen": "b"}], "no rejected column"),
        ([{"prompt": "a", "rejected": "b"}], "no chosen column"),
        (
            [good, good, good, {"prompt": "a", "chosen": "b", "rejected": None}],
            "preference example 3: empty or missing 'rejected'",
        ),
        ([conv, {**conv, "chosen": []}], "preference example 1: empty or missing 'chosen'"),  # conversational
        ([good, good, {"prompt": "x" * 200, "chosen": "b", "rejected": "c"}], "preference example 2: its prompt alone"),
    ]
    for rows, text in cases:
        with pytest.raises(DataError, match=text):
            tokenize_preference(Dataset.from_list(rows), tok, 64)
    with pytest.raises(DataError, match="preference example 0: prompt \\+ completion has"):
        tokenize_preference(
            Dataset.from_list([{"prompt": "a", "chosen": "b" * 80, "rejected": "c"}]), tok, 64, truncation="drop"
        )


def test_option_problems_are_one_line_each_before_loading():
    from hfpar.backends.strategies import STRATEGY
    from hfpar.config import parse_args
    from hfpar.recipes.dpo import DPOArgs, dpo_problems

    ctx = SimpleNamespace(strategy=STRATEGY["zero3"])
    args = parse_args(["--loss_type", "kto", "--label_smoothing", "0.5"], recipe="dpo", args_class=DPOArgs)
    p = dpo_problems(args, ctx)
    # ZeRO-3 runs a live reference now (hfpar.objectives.reference.ZeRO3Reference): no third line refusing it
    assert len(p) == 2 and p[0].startswith("--loss_type 'kto': valid values are sigmoid, hinge")
    assert "--label_smoothing 0.5" in p[1]
    ok = parse_args(["--precompute_ref_log_probs", "true"], recipe="dpo", args_class=DPOArgs)
    assert dpo_problems(ok, ctx) == []
    multi = ["--precompute_ref_log_probs", "true", "--loss_type", "sigmoid,sppo_hard"]  # TRL's multi-loss
    assert dpo_problems(parse_args([*multi, "--loss_weights", "0.8,0.2"], recipe="dpo", args_class=DPOArgs), ctx) == []
    for bad in ("1", "0.8,x"):
        p = dpo_problems(parse_args([*multi, "--loss_weights", bad], recipe="dpo", args_class=DPOArgs), ctx)
        assert p == [f"--loss_weights '{bad}': one number per --loss_type entry (2), comma-separated"]


def test_moe_configs_never_pack_pairs():
    """One helper reads a config's routed-expert count (config_num_experts, resolved once into the run plan): every
    field name transformers' MoE configs use, Ernie-4.5-MoE's moe_num_experts included, so no MoE run packs pairs."""
    from transformers import AutoConfig

    from hfpar.config import parse_args
    from hfpar.parallel.expert_parallel import config_num_experts
    from hfpar.recipes.dpo import DPOArgs, packs_pairs

    args = parse_args([], recipe="dpo", args_class=DPOArgs)
    for model_type, experts in (("ernie4_5_moe", 64), ("mixtral", 8), ("qwen2_moe", 60), ("deepseek_v3", 256)):
        n = config_num_experts(AutoConfig.for_model(model_type))
        assert n == experts and not packs_pairs(args, SimpleNamespace(num_experts=n)), model_type
    assert config_num_experts(AutoConfig.for_model("llama")) is None and packs_pairs(
        args, SimpleNamespace(num_experts=None)
    )
