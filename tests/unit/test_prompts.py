"""GRPO's prompt-only data (hfpar/data/prompts.py), the embedded GRPO task and its shipped warm start.

    python -m pytest -q tests/unit/test_prompts.py

Prompts are tokenized as TRL 1.16's GRPOTrainer does (standard: the tokenizer's special tokens; conversational: the
chat template with the generation prompt), extra columns are kept for the reward functions, and bad prompts are
refused in one line before any model loads. The embedded task is deterministic with a held-out eval split, its answers
pass the builtin reward, and the warm start answers most eval prompts right greedily.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hfpar import data
from hfpar.data import DataError
from hfpar.data.grpo_task import all_prompts, make_grpo_task
from hfpar.data.prompts import left_pad, load_prompts, tokenize_prompts
from hfpar.rollout.rewards import exact_match

# greedy accuracy of the shipped warm start on the first 20 eval prompts: 0.80 measured (0.86 on all 64); floor below
GREEDY_FLOOR = 0.6


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(None)


@pytest.fixture
def one_thread():
    """One torch thread while the test runs (restored after): on 2 shared cores a 20-row greedy decode takes ~1 s on
    one thread and up to a minute on two that other jobs also load (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _args(name=None, **kw):
    return SimpleNamespace(dataset_name=name, max_prompt_length=kw.pop("max_prompt_length", None), seed=42, **kw)


def _write(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_standard_prompts_tokenized_with_special_tokens_and_columns_kept(tmp_path, tok):
    rows = [{"prompt": "add 3 4 =", "answer": "7", "level": 1}, {"prompt": "add 10 5 =", "answer": "15", "level": 2}]
    train, evals, stats = load_prompts(_args(str(_write(tmp_path, rows)), eval_steps=0), tok)
    assert evals is None and len(train) == 2 and train.columns == ["answer", "level"]
    assert train[1] == {**rows[1], "prompt_ids": tok(text="add 10 5 =")["input_ids"]}
    assert train[0]["prompt_ids"][0] == tok.bos_token_id  # as TRL: processing_class(text=prompts)
    assert train.column_values([1, 1, 0]) == {"answer": ["15", "15", "7"], "level": [2, 2, 1]}
    assert stats["format"] == "standard" and stats["train_prompts"] == 2 and stats["eval_prompts"] == 0


def test_conversational_prompts_use_the_chat_template_with_generation_prompt(tmp_path, tok):
    msgs = [{"role": "system", "content": "be exact."}, {"role": "user", "content": "repeat k 3"}]
    rows = [{"prompt": msgs, "answer": "kkk"}, {"prompt": msgs[1:], "answer": "kkk"}]
    _write(tmp_path, rows, "train.jsonl")
    _write(tmp_path, rows[:1], "eval.jsonl")
    train, evals, stats = load_prompts(_args(str(tmp_path), eval_steps=5), tok)
    for ps in (train, evals):
        for i in range(len(ps)):
            want = tok.apply_chat_template(ps[i]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
            assert ps[i]["prompt_ids"] == list(want["input_ids"])  # TRL 1.16's _tokenize_prompts
            assert tok.decode(ps[i]["prompt_ids"]).endswith("<|assistant|>\n")
    assert train[0]["prompt"] == msgs and train[0]["answer"] == "kkk"
    assert stats["format"] == "conversational" and len(evals) == 1


def test_eval_split_carved_only_when_evaluating_and_capped(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(40)]
    path = str(_write(tmp_path, rows))
    train, evals, _ = load_prompts(_args(path, eval_steps=10), tok)
    assert len(train) + len(evals) == 40 and len(evals) == 2
    assert not set(train.prompts) & set(evals.prompts)
    _, evals, _ = load_prompts(_args(None, eval_steps=10, max_eval_samples=5), tok)
    assert len(evals) == 5


@pytest.mark.parametrize(
    "rows, limit, match",
    [
        ([{"prompt": "short"}, {"prompt": "a much longer prompt"}], 8, r"example 1: the prompt is 21 tokens.* 8"),
        ([{"question": "q", "answer": "a"}], None, r"no 'prompt' column \(found answer, question\)"),
        ([{"prompt": "ok"}, {"prompt": "  "}], None, r"example 1: the prompt is empty"),
        ([{"prompt": [{"role": "user", "content": ""}]}], None, r"example 0: the prompt is empty"),
        ([{"prompt": "ok", "completions": "x"}], None, r"column 'completions' has the name of a reward"),
        ([{"prompt": 7}], None, r"example 0: prompt 7 is neither a string nor a list"),
    ],
)
def test_bad_prompts_refused_in_one_line(tmp_path, tok, rows, limit, match):
    with pytest.raises(DataError, match=match) as exc:
        load_prompts(_args(str(_write(tmp_path, rows)), eval_steps=0, max_prompt_length=limit), tok)
    assert "\n" not in str(exc.value)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_embedded_task_deterministic_disjoint_and_checkable(tok):
    a, b, other = make_grpo_task(42), make_grpo_task(42), make_grpo_task(7)
    assert a["train"].to_list() == b["train"].to_list()
    assert a["eval"].to_list() == other["eval"].to_list()  # the held-out split does not move with the seed
    assert a["train"]["answer"] != other["train"]["answer"]  # the seed orders train
    train = {r["prompt"][0]["content"] for r in a["train"]}
    evals = {r["prompt"][0]["content"] for r in a["eval"]}
    assert not train & evals and len(train) + len(evals) == len(all_prompts()) == 572
    hand = {"repeat k 3": "kkk", "repeat Q 7": "QQQQQQQ", "repeat z 12": "zzzzzzzzzzzz"}
    assert {q: a for q, a in all_prompts() if q in hand} == hand
    for split in ("train", "eval"):
        rows = a[split].to_list()
        requests = [r["prompt"][0]["content"].split() for r in rows]  # ["repeat", letter, n]
        written = [letter * int(n) for _, letter, n in requests]
        completions = [[{"role": "assistant", "content": w}] for w in written]
        assert exact_match(None, completions, [r["answer"] for r in rows]) == [1.0] * len(rows)
        wrong = [[{"role": "assistant", "content": w + w[0]}] for w in written]
        assert exact_match(None, wrong, [r["answer"] for r in rows]) == [0.0] * len(rows)
    train_set, eval_set, stats = load_prompts(_args(None, eval_steps=10, max_prompt_length=32), tok)
    assert train_set.columns == ["answer"] and stats["prompt_tokens_max"] <= 17 and len(eval_set) == 64


def test_shipped_warm_start_loads_and_answers_greedily(one_thread):
    assert data.GRPO_START == data.grpo_start_path()
    model = AutoModelForCausalLM.from_pretrained(data.GRPO_START).eval()
    tok = data.load_tokenizer(data.GRPO_START)
    assert model.config.model_type == "llama" and model.config.vocab_size == 128 and tok.eos_token_id == 2
    prompts = make_grpo_task(42)["eval"].select(range(20))
    ps = tokenize_prompts(prompts, tok)
    assert ps.prompt_ids == tokenize_prompts(prompts, data.load_tokenizer(None)).prompt_ids  # the same tokenizer
    ids, mask = left_pad(ps.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=2, pad_token_id=0
        )[:, ids.size(1) :]
    completions = [[{"role": "assistant", "content": tok.decode(r, skip_special_tokens=True)}] for r in out]
    accuracy = sum(exact_match(None, completions, ps.column_values(list(range(20)))["answer"])) / 20
    assert accuracy >= GREEDY_FLOOR, accuracy
