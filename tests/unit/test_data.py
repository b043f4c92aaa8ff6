"""hfpar.data + hfpar.data.synthetic: embedded assets, loading, masking, packing (no attention leak), collation,
and one-line DataErrors. Offline, single process:  python -m pytest tests/unit/test_data.py -q
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datasets import ClassLabel, Dataset  # noqa: E402

from hfpar import data  # noqa: E402
from hfpar.data import IGNORE, DataError  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(None)


def _config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(data.embedded_model_path())


def _raises_one_line(fn, *needles):
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


# ---------------------------------------------------------------------------------- embedded assets
def test_embedded_tokenizer_and_config_load_offline(tok):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    assert data.load_tokenizer(data.EMBEDDED).get_vocab() == tok.get_vocab()
    assert AutoTokenizer.from_pretrained(data.embedded_model_path()).get_vocab() == tok.get_vocab()
    cfg = _config()
    assert len(tok) == cfg.vocab_size == 128 and cfg.vocab_size % 8 == 0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 4, 2)
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings == 512
    assert tok("ab")["input_ids"] == [tok.bos_token_id] + tok.convert_tokens_to_ids(["a", "b"])
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<s><|system|>\ns</s><|user|>\nu</s><|assistant|>\na</s>"
    assert tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True).endswith("<|assistant|>\n")
    lm = AutoModelForCausalLM.from_config(cfg)
    assert lm(input_ids=torch.tensor([[1, 50, 60]])).logits.shape == (1, 3, 128)
    cfg.num_labels = 3
    clf = AutoModelForSequenceClassification.from_config(cfg)
    feats = [{"input_ids": [1, 50], "labels": 0}, {"input_ids": [1, 50, 60, 70], "labels": 2}]
    batch = data.DataCollator(tok, task="classify")(feats)
    assert clf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.shape == (2, 3)


def test_embedded_datasets_are_deterministic_and_disjoint():
    for kind, cols in [("sft", ["messages"]), ("clm", ["text"]), ("classify", ["text", "label"])]:
        a, b, c = (data.load_splits(None, kind, seed=s) for s in (1, 1, 2))
        assert set(a) == {"train", "eval"} and a["train"].column_names == cols
        assert len(a["train"]) >= 2000 and 100 <= len(a["eval"]) <= 500
        assert a["train"][:50] == b["train"][:50] and a["eval"][:] == b["eval"][:]
        assert a["train"][:50] != c["train"][:50]
        key = (lambda r: r["messages"][-2]["content"]) if kind == "sft" else (lambda r: r["text"])
        assert not {key(r) for r in a["eval"]} & {key(r) for r in a["train"]}
    sft = data.load_splits(None, "sft")["train"]
    n_completion = [len(m[-1]["content"]) for m in sft["messages"]]
    assert min(n_completion) <= 2 and max(n_completion) >= 60  # very different completion lengths
    clf = data.load_splits(None, "classify")["train"]
    assert isinstance(clf.features["label"], ClassLabel) and clf.features["label"].num_classes == 4


# ------------------------------------------------------------------------------------- SFT masking
def _trained(tok, row):
    """The tokens that carry a label, as strings."""
    return [t for t, lab in zip(tok.convert_ids_to_tokens(row["input_ids"]), row["labels"]) if lab != IGNORE]


def test_messages_loss_only_on_assistant_turns(tok):
    chat = [
        {"role": "system", "content": "be"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "abc"},
    ]
    ds, stats = data.tokenize_sft(Dataset.from_dict({"messages": [chat]}), tok, 64)
    row = ds[0]
    tokens = tok.convert_ids_to_tokens(row["input_ids"])
    assert (
        "".join(tokens)
        == "<s><|system|>\nbe</s><|user|>\nhi</s><|assistant|>\nyo</s><|user|>\nq</s><|assistant|>\nabc</s>"
    )
    expected = []
    in_reply = False
    for i, t in enumerate(tokens):  # token by token: the reply after "<|assistant|>\n" up to and including </s>
        if i >= 2 and tokens[i - 2] == "<|assistant|>":
            in_reply = True
        expected.append(row["input_ids"][i] if in_reply else IGNORE)
        if t == "</s>":
            in_reply = False
    assert row["labels"] == expected
    assert _trained(tok, row) == ["y", "o", "</s>", "a", "b", "c", "</s>"]
    assert stats == {
        "examples": 1,
        "truncated": 0,
        "dropped": 0,
        "no_targets": 0,
        "cut_away": 0,
        "tokens": len(tokens),
        "target_tokens": 7,
    }
    full, _ = data.tokenize_sft(Dataset.from_dict({"messages": [chat]}), tok, 64, completion_only_loss=False)
    assert full[0]["labels"] == full[0]["input_ids"] == row["input_ids"]


def test_assistant_spans_without_offsets_and_with_odd_templates(tok):
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "abc"},
    ]
    text, spans = data._render_chat(tok, chat, 0, 0)
    fast = data._tokenize_spans(tok, [text], [spans], False, use_offsets=True)
    slow = data._tokenize_spans(tok, [text], [spans], False, use_offsets=False)  # slow tokenizers' path
    assert fast == slow
    # A template that renders the last assistant turn differently from earlier ones (like reasoning
    # models dropping old thoughts): the prefix difference fails, the reply is located instead.
    odd = data.load_tokenizer(None)
    odd.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and loop.last %}"
        "[final]{% endif %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ds, _ = data.tokenize_sft(Dataset.from_dict({"messages": [chat]}), odd, 64)
    assert _trained(odd, ds[0]) == ["y", "o", "</s>", "[", "f", "i", "n", "a", "l", "]", "a", "b", "c", "</s>"]


def test_prompt_completion_and_text_formats(tok):
    ds, _ = data.tokenize_sft(Dataset.from_dict({"prompt": ["Q: 1+1?", ""], "completion": [" A: 2", "xy"]}), tok, 64)
    r = ds[0]
    assert "".join(tok.convert_ids_to_tokens(r["input_ids"])) == "<s>Q: 1+1? A: 2</s>"
    assert r["labels"] == [IGNORE] * 8 + r["input_ids"][8:]  # bos + "Q: 1+1?" masked; " A: 2</s>" trained
    assert _trained(tok, ds[1]) == ["x", "y", "</s>"]  # empty prompt: bos still not a target
    conv = {"prompt": [[{"role": "user", "content": "hi"}]], "completion": [[{"role": "assistant", "content": "yo"}]]}
    ds, _ = data.tokenize_sft(Dataset.from_dict(conv), tok, 64)
    assert _trained(tok, ds[0]) == ["y", "o", "</s>"]
    ds, _ = data.tokenize_sft(Dataset.from_dict({"text": ["hello"]}), tok, 64)
    assert ds[0]["labels"] == ds[0]["input_ids"] and tok.convert_ids_to_tokens(ds[0]["input_ids"]) == [
        "<s>",
        *"hello",
        "</s>",
    ]


def test_truncate_vs_drop(tok):
    ds = Dataset.from_dict({"prompt": ["p", "p", "p" * 30], "completion": ["short", "x" * 40, "late"]})
    out, stats = data.tokenize_sft(ds, tok, 16)  # row 3: the completion starts after the cut -> no targets
    assert stats == {
        "examples": 3,
        "truncated": 2,
        "dropped": 0,
        "no_targets": 1,
        "cut_away": 1,
        "tokens": 8 + 16,
        "target_tokens": 6 + 14,
    }
    assert [len(x) for x in out["input_ids"]] == [8, 16]
    out, stats = data.tokenize_sft(ds, tok, 16, truncation="drop")
    assert (stats["truncated"], stats["dropped"], len(out)) == (0, 2, 1)
    _raises_one_line(lambda: data.tokenize_sft(ds.select([1, 2]), tok, 16, truncation="drop"), "no SFT example left")
    _raises_one_line(lambda: data.tokenize_sft(ds, tok, 16, truncation="chop"), "'chop'", "truncate, drop")


def test_messages_need_a_chat_template():
    plain = data.load_tokenizer(None)
    plain.chat_template = None
    ds = Dataset.from_dict({"messages": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]]})
    _raises_one_line(lambda: data.tokenize_sft(ds, plain, 32), "no chat template")
    bad = Dataset.from_dict({"messages": [[{"role": "robot", "content": "a"}]]})
    _raises_one_line(lambda: data.tokenize_sft(bad, data.load_tokenizer(None), 32), "example 0", "robot")


# ------------------------------------------------------------------------------ CLM and classification
def test_clm_chunks_with_document_positions(tok):
    texts = ["abc", "", "hello world", "  ", "xyz" * 10]
    ds, stats = data.tokenize_clm(Dataset.from_dict({"text": texts}), tok, 16)
    docs = [[tok.bos_token_id] + tok.convert_tokens_to_ids(list(t)) + [tok.eos_token_id] for t in texts if t.strip()]
    stream = [t for d in docs for t in d]
    assert [t for row in ds["input_ids"] for t in row] == stream
    assert all(len(r) <= 16 for r in ds["input_ids"]) and ds["labels"] == ds["input_ids"]
    assert (stats["examples"], stats["dropped"], stats["tokens"]) == (5, 2, len(stream))
    for ids, pos in zip(ds["input_ids"], ds["position_ids"]):
        assert pos[0] == 0
        for i in range(1, len(ids)):  # restart exactly at each bos (document start)
            assert (pos[i] == 0) == (ids[i] == tok.bos_token_id) and (pos[i] == 0 or pos[i] == pos[i - 1] + 1)


def test_classify_labels(tok):
    ds = Dataset.from_dict({"text": ["a", "bb", "ccc"], "label": ["pos", "neg", "pos"]})
    out, stats, n = data.tokenize_classify(ds, tok, 8)
    assert n == 2 and stats["label_names"] == ["neg", "pos"] and out["labels"] == [1, 0, 1]
    out, stats, n = data.tokenize_classify(Dataset.from_dict({"text": ["a", "b"], "label": [0, 3]}), tok, 8)
    assert (
        n == 4 and out["labels"] == [0, 3] and out["input_ids"][0] == [tok.bos_token_id, tok.convert_tokens_to_ids("a")]
    )
    emb = data.load_splits(None, "classify")
    out, stats, n = data.tokenize_classify(emb["eval"], tok, 64)
    assert n == 4 and stats["label_names"] == ["sports", "food", "weather", "music"]
    long_short = Dataset.from_dict({"text": ["abcdef", "ab"], "label": [0, 1]})
    out, stats, _ = data.tokenize_classify(long_short, tok, 4, truncation="drop")
    assert stats["dropped"] == 1 and out["labels"] == [1]
    _raises_one_line(lambda: data.tokenize_classify(ds, tok, 8, label_names=["pos"]), "'neg'", "['pos']")
    _raises_one_line(lambda: data.tokenize_classify(Dataset.from_dict({"text": ["a"], "label": [-1]}), tok, 8), "-1")


# ------------------------------------------------------------------------------ packing and collation
def _samples(tok):
    chats = [
        [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        for u, a in [("repeat k 3", "kkk"), ("count 1 to 12", "1 2 3 4 5 6 7 8 9 10 11 12"), ("hi", "yo")]
    ]
    ds, _ = data.tokenize_sft(Dataset.from_dict({"messages": chats}), tok, 64)
    return ds


def test_pack_positions_and_labels(tok):
    ds = _samples(tok)
    lens = [len(x) for x in ds["input_ids"]]  # 20, 46, 11
    packed = data.pack(ds, 64)
    assert [len(r) for r in packed["input_ids"]] == [lens[0], lens[1] + lens[2]]
    assert [t for r in packed["input_ids"] for t in r] == [t for r in ds["input_ids"] for t in r]
    pos = packed[1]["position_ids"]
    assert pos == list(range(lens[1])) + list(range(lens[2]))
    expected = [IGNORE] + ds[1]["labels"][1:] + [IGNORE] + ds[2]["labels"][1:]  # no target across the boundary
    assert packed[1]["labels"] == expected


def _sum_loss(logits, labels):
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_rows_do_not_leak_attention(tok, attn):
    """A packed (and padded) batch gives each sample exactly the logits and loss it gets alone."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation=attn).eval()
    ds = _samples(tok)
    packed = data.pack(ds, 64)
    batch = data.DataCollator(tok, pad_to_multiple_of=8)([packed[0], packed[1]])  # row 0 is padded
    assert "attention_mask" not in batch and batch["position_ids"].shape == (2, 64)
    with torch.no_grad():
        for use_cache in ({"use_cache": False}, {}):  # the embedded config defaults to use_cache false
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **use_cache).logits
            alone = [model(input_ids=torch.tensor([ids])).logits[0] for ids in ds["input_ids"]]
            lens = [len(x) for x in ds["input_ids"]]
            got = [logits[0, : lens[0]], logits[1, : lens[1]], logits[1, lens[1] : lens[1] + lens[2]]]
            for g, a in zip(got, alone):
                torch.testing.assert_close(g, a, atol=1e-5, rtol=0)
        unpacked = data.DataCollator(tok)([ds[i] for i in range(3)])
        ref = _sum_loss(
            model(input_ids=unpacked["input_ids"], attention_mask=unpacked["attention_mask"]).logits, unpacked["labels"]
        )
        torch.testing.assert_close(_sum_loss(logits, batch["labels"]), ref, atol=1e-4, rtol=1e-6)
        assert int((batch["labels"][:, 1:] != IGNORE).sum()) == int((unpacked["labels"][:, 1:] != IGNORE).sum())


def test_collator_padding(tok):
    ds = _samples(tok)
    n0, n2 = len(ds[0]["input_ids"]), len(ds[2]["input_ids"])  # 20, 11
    b = data.DataCollator(tok)([ds[0], ds[2]])
    assert set(b) == {"input_ids", "labels", "attention_mask"} and b["input_ids"].shape == (2, n0)
    assert b["input_ids"][1, n2:].eq(tok.pad_token_id).all() and b["labels"][1, n2:].eq(IGNORE).all()
    assert b["labels"][1, :n2].tolist() == ds[2]["labels"] and b["input_ids"].dtype == torch.long
    assert b["attention_mask"].sum(1).tolist() == [n0, n2] and b["attention_mask"][1, :n2].eq(1).all()
    b = data.DataCollator(tok, pad_to_multiple_of=8)([ds[0], ds[2]])
    assert b["input_ids"].shape == (2, 24)
    packed = data.pack(ds, 64)
    b = data.DataCollator(tok)([packed[0], packed[1]])
    assert set(b) == {"input_ids", "labels", "position_ids", "token_mask"} and b["position_ids"][0, n0:].eq(0).all()
    assert b["token_mask"].sum(1).tolist() == [len(packed[0]["input_ids"]), len(packed[1]["input_ids"])]
    assert b["labels"][0, n0:].eq(IGNORE).all() and b["position_ids"][1].tolist() == packed[1]["position_ids"]
    c = data.DataCollator(tok, task="classify")(
        [{"input_ids": [1, 2, 3], "labels": 1}, {"input_ids": [1], "labels": IGNORE}]
    )
    assert c["labels"].tolist() == [1, IGNORE] and c["labels"].shape == (2,) and c["labels"].dtype == torch.long
    assert c["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# --------------------------------------------------------------------------------------- local files
def _rows():
    return [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(20)]


def test_local_files_load(tmp_path):
    rows = _rows()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    Dataset.from_list(rows).to_csv(tmp_path / "a.csv", index=False)
    Dataset.from_list(rows).to_parquet(tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "a.csv", "a.parquet"):
        dd = data.load_splits(str(tmp_path / name), "sft", eval_split_fraction=0.1, seed=3)
        assert (len(dd["train"]), len(dd["eval"])) == (18, 2), name
        assert sorted(list(dd["train"]["prompt"]) + list(dd["eval"]["prompt"])) == sorted(r["prompt"] for r in rows)
        again = data.load_splits(str(tmp_path / name), "sft", eval_split_fraction=0.1, seed=3)
        assert again["eval"]["prompt"] == dd["eval"]["prompt"]  # deterministic carve
    (tmp_path / "t.txt").write_text("the cat\nthe dog\n\nthe bird\n" * 5)
    dd = data.load_splits(str(tmp_path / "t.txt"), "clm")
    assert len(dd["train"]) + len(dd["eval"]) == 20 and dd["train"].column_names == ["text"]
    d = tmp_path / "dir"
    d.mkdir()
    (d / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"t{i}", "label": ["b", "a"][i % 2]}) + "\n" for i in range(6))
    )
    (d / "test.jsonl").write_text(json.dumps({"text": "e", "label": "c"}) + "\n")
    dd = data.load_splits(str(d), "classify")
    assert (len(dd["train"]), len(dd["eval"])) == (6, 1)  # test.* is the eval split
    names = ["a", "b", "c"]  # one sorted mapping for both splits, including a label only eval has
    assert dd["train"].features["label"].names == dd["eval"].features["label"].names == names
    assert dd["train"]["label"] == [1, 0, 1, 0, 1, 0] and dd["eval"]["label"] == [2]


def test_bad_inputs_raise_one_line_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    _raises_one_line(lambda: data.load_splits(str(missing), "sft"), missing, "no such file")
    xlsx = tmp_path / "data.xlsx"
    xlsx.write_text("x")
    _raises_one_line(lambda: data.load_splits(str(xlsx), "sft"), xlsx, "'.xlsx'", ".jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",\n')
    _raises_one_line(lambda: data.load_splits(str(bad), "clm"), bad, "line 3")
    badj = tmp_path / "bad.json"
    badj.write_text('[\n  {"text": "a"},\n  {"text": "b"\n]')
    _raises_one_line(lambda: data.load_splits(str(badj), "clm"), badj, "line 4")
    obj = tmp_path / "obj.json"
    obj.write_text('{\n  "data": [{"text": "a"}]\n}')
    _raises_one_line(lambda: data.load_splits(str(obj), "clm"), obj, "expected a list of objects or JSON Lines")
    lines = tmp_path / "lines.json"  # JSON Lines in a .json file is fine
    lines.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert len(data.load_splits(str(lines), "clm")["train"]) == 1
    msgs = Dataset.from_dict({"messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": None}]]})
    _raises_one_line(lambda: data.tokenize_sft(msgs, data.load_tokenizer(None), 32), "example 1", "'content'")
    cols = tmp_path / "cols.jsonl"
    cols.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    _raises_one_line(
        lambda: data.load_splits(str(cols), "sft"), "['answer', 'question']", "messages", "prompt + completion"
    )
    _raises_one_line(lambda: data.load_splits(str(cols), "classify"), "['answer', 'question']", "text + label")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _raises_one_line(lambda: data.load_splits(str(empty), "clm"), empty, "empty")
    (tmp_path / "emptydir").mkdir()
    _raises_one_line(lambda: data.load_splits(str(tmp_path / "emptydir"), "clm"), "emptydir", "no data files")
    _raises_one_line(lambda: data.load_splits(None, "pretrain"), "'pretrain'", "sft, clm, classify")
    _raises_one_line(lambda: data.load_tokenizer(str(tmp_path / "no_tokenizer")), "no_tokenizer")


def test_tokenizer_pad_fallback(tmp_path, tok):
    from transformers import AutoTokenizer

    no_pad = AutoTokenizer.from_pretrained(data.embedded_model_path())
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path / "no_pad")
    loaded = data.load_tokenizer(str(tmp_path / "no_pad"))
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    no_pad.eos_token = None
    no_pad.save_pretrained(tmp_path / "no_eos")
    _raises_one_line(lambda: data.load_tokenizer(str(tmp_path / "no_eos")), "no_eos", "neither a pad nor an eos")
