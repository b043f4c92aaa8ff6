"""The on-disk cache of tokenized splits (hfpar/data/cache.py): a hit returns exactly what tokenizing returns,
without tokenizing; every input that changes the result changes the key; it can be switched off."""

from __future__ import annotations

import datasets
import pytest

from hfpar import data
from hfpar.data import cache


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HFPAR_TOKENIZED_CACHE", raising=False)
    return tmp_path / "hf" / "hfpar_tokenized"


@pytest.fixture(scope="module")
def sft():
    return data.load_tokenizer(None), data.load_splits(None, "sft", eval_split_fraction=0.05, seed=42)


def _counting(fn):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped, calls


def test_hit_equals_tokenizing_and_skips_it(tmp_cache, sft):
    tok, splits = sft
    fn, calls = _counting(data.tokenize_sft)
    ref_rows, ref_stats = data.tokenize_sft(splits["eval"], tok, 96, completion_only_loss=True)
    first = cache.cached(fn, splits["eval"], tok, 96, completion_only_loss=True)
    second = cache.cached(fn, splits["eval"], tok, 96, completion_only_loss=True)
    assert len(calls) == 1 and len(list(tmp_cache.iterdir())) == 1
    for rows, stats in (first, second):
        assert stats == ref_stats
        assert rows["input_ids"] == ref_rows["input_ids"] and rows["labels"] == ref_rows["labels"]


def test_classify_extras_round_trip(tmp_cache):
    tok = data.load_tokenizer(None)
    split = data.load_splits(None, "classify", eval_split_fraction=0.05, seed=42)["eval"]
    ref = data.tokenize_classify(split, tok, 32)
    for _ in range(2):
        rows, stats, num_labels = cache.cached(data.tokenize_classify, split, tok, 32)
        assert (stats, num_labels) == ref[1:] and rows["labels"] == ref[0]["labels"]


def test_every_input_is_in_the_key(tmp_cache, sft):
    tok, splits = sft
    base = cache.cache_key(data.tokenize_sft, splits["eval"], tok, (96,), {"completion_only_loss": True})
    other_tok = data.load_tokenizer(None)
    other_tok.chat_template = other_tok.chat_template + " "
    variants = [
        cache.cache_key(data.tokenize_sft, splits["eval"], tok, (64,), {"completion_only_loss": True}),
        cache.cache_key(data.tokenize_sft, splits["eval"], tok, (96,), {"completion_only_loss": False}),
        cache.cache_key(data.tokenize_sft, splits["train"], tok, (96,), {"completion_only_loss": True}),
        cache.cache_key(data.tokenize_clm, splits["eval"], tok, (96,), {"completion_only_loss": True}),
        cache.cache_key(data.tokenize_sft, splits["eval"], other_tok, (96,), {"completion_only_loss": True}),
    ]
    assert base is not None and base not in variants and len(set(variants)) == len(variants)
    assert base == cache.cache_key(
        data.tokenize_sft, splits["eval"], data.load_tokenizer(None), (96,), {"completion_only_loss": True}
    )  # same inputs, same key


def test_switched_off(tmp_cache, sft, monkeypatch):
    tok, splits = sft
    fn, calls = _counting(data.tokenize_sft)
    monkeypatch.setenv("HFPAR_TOKENIZED_CACHE", "0")
    for _ in range(2):
        cache.cached(fn, splits["eval"], tok, 96)
    assert len(calls) == 2 and not tmp_cache.exists()


def test_errors_are_not_cached(tmp_cache, sft):
    tok, splits = sft
    for _ in range(2):
        with pytest.raises(data.DataError, match="max_seq_length 1"):
            cache.cached(data.tokenize_sft, splits["eval"], tok, 1)
    assert not tmp_cache.exists() or not list(tmp_cache.iterdir())
