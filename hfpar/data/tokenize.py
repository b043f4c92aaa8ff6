"""Tokenize: SFT (TRL formats, loss masks), CLM (packed stream) and classification rows; labels unshifted.

train, stats = tokenize_sft(splits["train"], tokenizer, 128)  # input_ids, labels (-100 = no loss)
"""

from __future__ import annotations

from datasets import ClassLabel, Dataset

from hfpar.parallel.labels import IGNORE  # noqa: F401  (re-exported: hfpar.data.IGNORE)

from .chat import _check_messages, _render_chat
from .errors import DataError
from .load import FORMATS, label_names_of


def _check_args(max_seq_length: int, truncation: str = "truncate") -> None:
    if not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise DataError(f"max_seq_length {max_seq_length!r}: must be an integer >= 2")
    if truncation not in ("truncate", "drop"):
        raise DataError(f"truncation {truncation!r}: valid values are truncate, drop")


def _as_text(value, column: str, index: int) -> str:
    if not isinstance(value, str):
        raise DataError(f"example {index}: column {column!r} holds {value!r}, expected a string")
    return value


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def _tokenize_spans(
    tokenizer, texts: list[str], spans: list[list], add_special_tokens: bool, use_offsets: bool | None = None
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each text + a mask of the tokens that overlap its character spans (the trained part).

    Fast tokenizers map tokens to characters with offsets (zero-width tokens added by the
    post-processor, like bos, are never in a span); others count the tokens of text prefixes.
    """
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if use_offsets:
        enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [
            (ids, [e > s and any(s < a1 and e > a0 for a0, a1 in sp) for s, e in offsets])
            for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans)
        ]
    lead = 1 if add_special_tokens and _adds_bos(tokenizer) else 0
    out = []
    for text, sp in zip(texts, spans):
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        mask = [False] * len(ids)
        for a0, a1 in sp:
            i0, i1 = (lead + len(tokenizer(text[:c], add_special_tokens=False)["input_ids"]) for c in (a0, a1))
            mask[i0:i1] = [True] * len(mask[i0:i1])
        out.append((ids, mask))
    return out


def _sft_examples(ds: Dataset, tokenizer) -> list[tuple[list[int], list[bool]]]:
    """(ids, trainable mask) per example for the three TRL formats."""
    cols = set(ds.column_names)
    eos = tokenizer.eos_token_id
    conversational_pc = {"prompt", "completion"} <= cols and len(ds) > 0 and isinstance(ds[0]["prompt"], list)
    if "messages" in cols or conversational_pc:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template, which the messages "
                "format needs; use a tokenizer with one, or prompt/completion or text columns"
            )
        if "messages" in cols:
            chats = [(_check_messages(m, i), 0) for i, m in enumerate(ds["messages"])]
        else:
            chats = [
                (_check_messages(p, i) + _check_messages(c, i), len(p))
                for i, (p, c) in enumerate(zip(ds["prompt"], ds["completion"]))
            ]
        rendered = [_render_chat(tokenizer, m, first, i) for i, (m, first) in enumerate(chats)]
        return _tokenize_spans(tokenizer, [r[0] for r in rendered], [r[1] for r in rendered], False)
    if {"prompt", "completion"} <= cols:
        prompts = [_as_text(p, "prompt", i) for i, p in enumerate(ds["prompt"])]
        completions = [_as_text(c, "completion", i) for i, c in enumerate(ds["completion"])]
        texts = [p + c for p, c in zip(prompts, completions)]
        out = _tokenize_spans(tokenizer, texts, [[(len(p), len(t))] for p, t in zip(prompts, texts)], True)
    elif "text" in cols:
        texts = [_as_text(t, "text", i) for i, t in enumerate(ds["text"])]
        out = [(ids, [True] * len(ids)) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    else:
        raise DataError(f"dataset has columns {sorted(cols)}; SFT expects {FORMATS['sft']}")
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end completions with")
    for ids, mask in out:  # the completion / text ends with eos, which is trained
        if not ids or ids[-1] != eos:
            ids.append(eos)
            mask.append(True)
        mask[-1] = True
    return out


def tokenize_sft(
    ds: Dataset, tokenizer, max_seq_length: int, *, completion_only_loss: bool = True, truncation: str = "truncate"
) -> tuple[Dataset, dict]:
    """TRL formats -> Dataset(input_ids, labels) + stats {examples, truncated, dropped, no_targets, ...}.

    messages           chat template; with completion_only_loss, loss on assistant turns only
    prompt/completion  strings (bos from the tokenizer, eos appended) or conversations; loss on the completion
    text               loss on every token; bos as the tokenizer adds it, eos appended
    labels = input_ids with untrained positions = -100, unshifted. Rows longer than max_seq_length
    are cut (truncation="truncate") or left out ("drop"); rows left without any target are left out.
    """
    _check_args(max_seq_length, truncation)
    stats = {
        "examples": len(ds),
        "truncated": 0,
        "dropped": 0,
        "no_targets": 0,
        "cut_away": 0,
        "tokens": 0,
        "target_tokens": 0,
    }  # cut_away: of no_targets, those whose targets truncation removed
    input_ids, labels = [], []
    for ids, mask in _sft_examples(ds, tokenizer):
        if not completion_only_loss:
            mask = [True] * len(ids)
        cut = len(ids) > max_seq_length
        if cut:
            if truncation == "drop":
                stats["dropped"] += 1
                continue
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
            stats["truncated"] += 1
        n_targets = sum(mask[1:])  # the first token is never a target (nothing precedes it)
        if n_targets == 0:
            stats["no_targets"] += 1
            stats["cut_away"] += cut
            continue
        input_ids.append(ids)
        labels.append([t if m else IGNORE for t, m in zip(ids, mask)])
        stats["tokens"] += len(ids)
        stats["target_tokens"] += n_targets
    if not input_ids:
        raise DataError(
            f"no SFT example left after tokenization with max_seq_length {max_seq_length} "
            f"and truncation {truncation!r} ({stats})"
        )
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels}), stats


def tokenize_clm(ds: Dataset, tokenizer, max_seq_length: int) -> tuple[Dataset, dict]:
    """Text -> Dataset(input_ids, labels, position_ids): packed by construction.

    Every document (bos as the tokenizer adds it, + eos) is concatenated into one stream, which is cut
    into rows of max_seq_length (the last row may be shorter). position_ids restart at 0 at every
    document start and at every row start, so attention never crosses documents (see `pack`).
    labels = input_ids; the target of a document's last token (eos) is the next document's first token.
    Empty / whitespace-only texts (blank lines of .txt files) are skipped and counted as dropped.
    """
    _check_args(max_seq_length)
    if "text" not in ds.column_names:
        raise DataError(f"dataset has columns {sorted(ds.column_names)}; CLM expects text")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to separate documents with")
    texts = [_as_text(t, "text", i) for i, t in enumerate(ds["text"])]
    docs = [t for t in texts if t.strip()]
    stream, positions = [], []
    for ids in tokenizer(docs, add_special_tokens=True)["input_ids"] if docs else []:
        ids = ids if ids and ids[-1] == eos else ids + [eos]
        stream += ids
        positions += range(len(ids))
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for start in range(0, len(stream), max_seq_length):
        ids, pos = stream[start : start + max_seq_length], positions[start : start + max_seq_length]
        if len(ids) < 2:
            continue
        first, j = pos[0], 0
        while j < len(pos) and (j == 0 or pos[j] != 0):  # a document continued from the previous row
            pos[j] -= first
            j += 1
        rows["input_ids"].append(ids)
        rows["labels"].append(list(ids))
        rows["position_ids"].append(pos)
    if not rows["input_ids"]:
        raise DataError(f"no CLM text left after tokenization ({len(texts)} texts, {len(texts) - len(docs)} empty)")
    stats = {
        "examples": len(texts),
        "truncated": 0,
        "dropped": len(texts) - len(docs),
        "chunks": len(rows["input_ids"]),
        "tokens": len(stream),
    }
    return Dataset.from_dict(rows), stats


def tokenize_classify(
    ds: Dataset, tokenizer, max_seq_length: int, *, truncation: str = "truncate", label_names: list[str] | None = None
) -> tuple[Dataset, dict, int]:
    """text + label -> (Dataset(input_ids, labels: int), stats, num_labels).

    ClassLabel columns keep their names; string labels map to sorted names (pass label_names to fix
    the mapping across splits; load_splits already casts both splits to one ClassLabel); int labels
    give num_labels = max + 1. stats["label_names"] holds the names (None for plain ints).
    """
    _check_args(max_seq_length, truncation)
    col = "label" if "label" in ds.column_names else "labels"
    if "text" not in ds.column_names or col not in ds.column_names:
        raise DataError(f"dataset has columns {sorted(ds.column_names)}; classification expects text + label")
    values = list(ds[col])
    feature = ds.features[col]
    if label_names is None and isinstance(feature, ClassLabel):
        label_names = list(feature.names)
    if label_names is None and all(isinstance(v, str) for v in values):
        label_names = label_names_of(values)
    num_labels = len(label_names) if label_names is not None else len(label_names_of(values))
    index = {n: i for i, n in enumerate(label_names or [])}
    labels = []
    for i, v in enumerate(values):
        lab = index.get(v) if isinstance(v, str) else v
        if isinstance(lab, bool) or not isinstance(lab, int) or not 0 <= lab < num_labels:
            valid = label_names if label_names is not None else f"integers 0..{num_labels - 1}"
            raise DataError(f"example {i}: label {v!r} is not one of {valid}")
        labels.append(lab)
    texts = [_as_text(t, "text", i) for i, t in enumerate(ds["text"])]
    stats = {
        "examples": len(texts),
        "truncated": 0,
        "dropped": 0,
        "num_labels": num_labels,
        "label_names": label_names if isinstance(feature, ClassLabel) or index else None,
    }
    rows = {"input_ids": [], "labels": []}
    for ids, lab in zip(tokenizer(texts, add_special_tokens=True)["input_ids"], labels):
        if len(ids) > max_seq_length:
            if truncation == "drop":
                stats["dropped"] += 1
                continue
            ids = ids[:max_seq_length]
            stats["truncated"] += 1
        rows["input_ids"].append(ids)
        rows["labels"].append(lab)
    if not rows["input_ids"]:
        raise DataError(f"no classification example left with max_seq_length {max_seq_length} ({stats})")
    return Dataset.from_dict(rows), stats, num_labels
