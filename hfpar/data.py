"""Data for every recipe: load -> format -> tokenize -> (pack) -> collate.

    from hfpar import data
    tok = data.load_tokenizer(None)                              # the embedded char-level tokenizer
    splits = data.load_splits(None, "sft")                       # DatasetDict(train, eval), generated
    train, stats = data.tokenize_sft(splits["train"], tok, 128)  # input_ids, labels (-100 = no loss)
    train = data.pack(train, 128)                                # + position_ids restarting per sample
    batch = data.DataCollator(tok)([train[i] for i in range(8)])
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits

Labels are NOT shifted: the target of position t is labels[t + 1] (the trainer shifts).

Packed rows (from `pack` or `tokenize_clm`) carry `position_ids` that restart at 0 at every sample;
the collator then returns position_ids and NO attention_mask. transformers 5 detects packing from
the position ids only when attention_mask is None AND no KV cache is built, so call the model with
`use_cache=False` (the embedded config also sets use_cache false). It then builds a block-diagonal
causal mask (eager, sdpa) or uses varlen kernels (flash attention): tests/test_data.py checks that
a packed row gives the same logits as its samples run one by one.

Every user mistake raises `DataError` (a ValueError) with a one-line message naming the value.
The embedded datasets live in hfpar/synthetic.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
from importlib import resources
from pathlib import Path

import torch
from datasets import ClassLabel, Dataset, DatasetDict

logger = logging.getLogger(__name__)

EMBEDDED = "hfpar-tiny"
KINDS = ("sft", "clm", "classify")
IGNORE = -100
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
EVAL_NAMES = ("eval", "validation", "valid", "dev", "test")
# Suffixes that mark a name as a (missing) file rather than a hub id.
FILE_LIKE = set(BUILDERS) | {".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".zst", ".bz2", ".xz", ".ndjson", ".pq"}


class DataError(ValueError):
    """Bad data or tokenizer input. The message is one line naming the offending value."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ------------------------------------------------------------------------------------- tokenizer
def embedded_model_path() -> str:
    """Directory of the embedded tiny Llama config + tokenizer (inside the installed package)."""
    return str(resources.files("hfpar") / "assets" / "tiny")


def load_tokenizer(name_or_path: str | None = None):
    """None or "hfpar-tiny" -> the embedded tokenizer, else AutoTokenizer.from_pretrained. Always has a pad token."""
    from transformers import AutoTokenizer

    path = embedded_model_path() if name_or_path in (None, EMBEDDED) else name_or_path
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"tokenizer {name_or_path!r} could not be loaded: {_one_line(exc)}") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"tokenizer {name_or_path!r} has neither a pad nor an eos token; give one that has")
        tok.pad_token = tok.eos_token
        logger.warning("tokenizer %s has no pad token; using eos %r as pad", name_or_path, tok.eos_token)
    return tok


# ------------------------------------------------------------------------------------------ load
def load_splits(dataset_name: str | None, kind: str, *, eval_split_fraction: float = 0.05,
                seed: int = 42) -> DatasetDict:
    """DatasetDict(train, eval) for a recipe kind, from the embedded generator, local files or the hub."""
    if kind not in KINDS:
        raise DataError(f"dataset kind {kind!r}: valid kinds are {', '.join(KINDS)}")
    if dataset_name is None:
        from hfpar.synthetic import embedded_splits

        return embedded_splits(kind, seed)
    raw = _load_raw(dataset_name)
    train, evals = _pick_splits(raw, dataset_name)
    if len(train) == 0:
        raise DataError(f"dataset {dataset_name}: the train split is empty")
    _check_columns(train, kind, dataset_name)
    if evals is None:
        train, evals = _carve_eval(train, eval_split_fraction, seed, dataset_name)
    else:
        _check_columns(evals, kind, dataset_name)
    out = DatasetDict(train=train, eval=evals)
    return _normalize_labels(out) if kind == "classify" else out


def _load_raw(name: str) -> DatasetDict:
    import datasets

    path = Path(name).expanduser()
    if path.is_dir():
        builder, data_files = _dir_files(path)
    elif path.is_file():
        builder, data_files = _builder_of(path), {"train": [str(path)]}
    elif _looks_like_path(name):
        raise DataError(f"dataset {name}: no such file or directory")
    else:  # a hub id; not exercised by the offline tests
        try:
            return _as_dict(datasets.load_dataset(name), name)
        except Exception as exc:  # noqa: BLE001  (network, missing repo, ...: one line for the user)
            raise DataError(f"dataset {name}: could not be loaded from the hub: {_one_line(exc)}") from None
    for files in data_files.values():
        for f in files:
            if builder == "json":
                _check_json(Path(f))
            elif os.path.getsize(f) == 0:
                raise DataError(f"dataset file {f} is empty")
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # reading a local file takes a moment: no "Generating train split" bars
    try:
        return _as_dict(datasets.load_dataset(builder, data_files=data_files), name)
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"dataset {name}: could not be read as {builder}: {_one_line(exc)}") from None
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
            or Path(name).suffix.lower() in FILE_LIKE)


def _builder_of(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"dataset file {path}: unsupported extension {path.suffix or '(none)'!r}; "
                        f"valid: {', '.join(BUILDERS)}")
    return builder


def _dir_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """Data files of a directory, grouped into splits by file name (train*, eval*/validation*/test*)."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    if not files:
        raise DataError(f"dataset {path}: the directory has no data files ({', '.join(BUILDERS)})")
    builders = {_builder_of(p) for p in files}
    if len(builders) > 1:
        raise DataError(f"dataset {path}: mixes file types {sorted(builders)}; keep one format per directory")
    splits: dict[str, list[str]] = {}
    for p in files:
        m = re.match(r"(train|eval|validation|valid|dev|test)(?![a-z])", p.stem.lower())  # train-0001, test_a
        splits.setdefault("train" if m is None else m.group(1), []).append(str(p))
    return builders.pop(), splits


def _check_json(path: Path) -> None:
    """Find malformed JSON / JSON Lines ourselves, to name the file and line (datasets' errors do not)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"dataset file {path} is empty")
    if path.suffix.lower() == ".json" and not _is_json_lines(text):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset file {path}: malformed JSON at line {exc.lineno} column {exc.colno}: "
                            f"{exc.msg}") from None
        if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
            raise DataError(f"dataset file {path}: expected a list of objects or JSON Lines, got a "
                            f"{type(obj).__name__}{' holding non-objects' if isinstance(obj, list) else ''}")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset file {path}: malformed JSON Lines at line {lineno}: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise DataError(f"dataset file {path}: line {lineno} is not a JSON object")


def _is_json_lines(text: str) -> bool:
    """A .json file may hold JSON Lines: its first line is then a whole JSON object."""
    try:
        return isinstance(json.loads(text.lstrip().splitlines()[0]), dict)
    except json.JSONDecodeError:
        return False


def _as_dict(ds, name: str) -> DatasetDict:
    if isinstance(ds, Dataset):
        return DatasetDict(train=ds)
    if not isinstance(ds, DatasetDict):
        raise DataError(f"dataset {name}: streaming / iterable datasets are not supported")
    return ds


def _pick_splits(raw: DatasetDict, name: str) -> tuple[Dataset, Dataset | None]:
    names = list(raw)
    if not names:
        raise DataError(f"dataset {name}: no splits found")
    train_name = "train" if "train" in raw else names[0]
    eval_name = next((s for s in EVAL_NAMES if s in raw and s != train_name), None)
    return raw[train_name], raw[eval_name] if eval_name else None


def _carve_eval(train: Dataset, fraction: float, seed: int, name: str) -> tuple[Dataset, Dataset]:
    """Deterministic eval split from train: a seeded permutation, at least one row each side."""
    n = len(train)
    if n < 2:
        raise DataError(f"dataset {name}: {n} row(s) are too few to carve an eval split from; "
                        "give at least 2 rows or an eval split")
    n_eval = min(n - 1, max(1, round(n * fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return train.select(sorted(perm[n_eval:])), train.select(sorted(perm[:n_eval]))


FORMATS = {"sft": "messages, or prompt + completion, or text", "clm": "text", "classify": "text + label"}


def _check_columns(ds: Dataset, kind: str, name: str) -> None:
    cols = set(ds.column_names)
    ok = {"sft": "messages" in cols or {"prompt", "completion"} <= cols or "text" in cols,
          "clm": "text" in cols,
          "classify": "text" in cols and bool({"label", "labels"} & cols)}[kind]
    if not ok:
        raise DataError(f"dataset {name}: found columns {sorted(cols)}; the {kind} recipe expects {FORMATS[kind]}")


def _normalize_labels(dd: DatasetDict) -> DatasetDict:
    """One ClassLabel for train and eval (sorted strings, or 0..max for ints), so both splits agree."""
    dd = DatasetDict({k: v if "label" in v.column_names else v.rename_column("labels", "label") for k, v in dd.items()})
    if isinstance(dd["train"].features["label"], ClassLabel):
        return dd
    names = label_names_of([v for split in dd.values() for v in split["label"]])
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for k, ds in dd.items():
        ids = [index[x] if isinstance(x, str) else x for x in ds["label"]]
        out[k] = ds.remove_columns("label").add_column("label", ids).cast_column("label", ClassLabel(names=names))
    return DatasetDict(out)


def label_names_of(values: list) -> list[str]:
    """Sorted distinct strings, or "0".."max" for non-negative ints; DataError otherwise."""
    if values and all(isinstance(v, str) for v in values):
        return sorted(set(values))
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0), None)
    if bad is not None or not values:
        raise DataError(f"label {bad!r}: labels must be all strings or all non-negative integers")
    return [str(i) for i in range(max(values) + 1)]


# ------------------------------------------------------------------------------------ tokenize
def _check_args(max_seq_length: int, truncation: str = "truncate") -> None:
    if not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise DataError(f"max_seq_length {max_seq_length!r}: must be an integer >= 2")
    if truncation not in ("truncate", "drop"):
        raise DataError(f"truncation {truncation!r}: valid values are truncate, drop")


def _as_text(value, column: str, index: int) -> str:
    if not isinstance(value, str):
        raise DataError(f"example {index}: column {column!r} holds {value!r}, expected a string")
    return value


def _check_messages(messages, index: int) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"example {index}: messages {messages!r} is not a non-empty list of {{role, content}}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"example {index}: message {m!r} needs a string 'role' and a string 'content'")
    return messages


def _render_chat(tokenizer, messages: list[dict], first_trainable: int, index: int) -> tuple[str, list]:
    """Rendered conversation + character spans of the assistant turns at index >= first_trainable.

    Turn k's span is what rendering messages[:k+1] adds to rendering messages[:k] with the generation
    prompt: the reply and whatever closes it (eos / end-of-turn). This works for any template, no
    {% generation %} markers needed. Templates that render earlier turns differently than the last one
    (e.g. dropping reasoning) fall back to locating the reply text in the full rendering.
    """
    from jinja2 import TemplateError

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    try:
        full = render(messages, False)
        spans, search_from = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k < first_trainable:
                continue
            upto = render(messages[: k + 1], False)
            before = render(messages[:k], True) if k else None
            if before is not None and full.startswith(upto) and upto.startswith(before):
                span = (len(before), len(upto))
            else:
                span = _locate_reply(full, m["content"], search_from, tokenizer.eos_token, index, k)
            spans.append(span)
            search_from = span[1]
    except TemplateError as exc:
        raise DataError(f"example {index}: the chat template failed: {_one_line(exc)}") from None
    return full, spans


def _locate_reply(full: str, content: str, start: int, eos: str | None, index: int, k: int) -> tuple[int, int]:
    pos = full.find(content, start)
    if pos < 0:
        raise DataError(f"example {index}: assistant message {k} does not appear in the rendered chat template")
    end = pos + len(content)
    if eos and full.startswith(eos, end):
        end += len(eos)
    return pos, end


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def _tokenize_spans(tokenizer, texts: list[str], spans: list[list], add_special_tokens: bool,
                    use_offsets: bool | None = None) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each text + a mask of the tokens that overlap its character spans (the trained part).

    Fast tokenizers map tokens to characters with offsets (zero-width tokens added by the
    post-processor, like bos, are never in a span); others count the tokens of text prefixes.
    """
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if use_offsets:
        enc = tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [(ids, [e > s and any(s < a1 and e > a0 for a0, a1 in sp) for s, e in offsets])
                for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans)]
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
            raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template, which the messages "
                            "format needs; use a tokenizer with one, or prompt/completion or text columns")
        if "messages" in cols:
            chats = [(_check_messages(m, i), 0) for i, m in enumerate(ds["messages"])]
        else:
            chats = [(_check_messages(p, i) + _check_messages(c, i), len(p))
                     for i, (p, c) in enumerate(zip(ds["prompt"], ds["completion"]))]
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


def tokenize_sft(ds: Dataset, tokenizer, max_seq_length: int, *, completion_only_loss: bool = True,
                 truncation: str = "truncate") -> tuple[Dataset, dict]:
    """TRL formats -> Dataset(input_ids, labels) + stats {examples, truncated, dropped, no_targets, ...}.

    messages           chat template; with completion_only_loss, loss on assistant turns only
    prompt/completion  strings (bos from the tokenizer, eos appended) or conversations; loss on the completion
    text               loss on every token; bos as the tokenizer adds it, eos appended
    labels = input_ids with untrained positions = -100, unshifted. Rows longer than max_seq_length
    are cut (truncation="truncate") or left out ("drop"); rows left without any target are left out.
    """
    _check_args(max_seq_length, truncation)
    stats = {"examples": len(ds), "truncated": 0, "dropped": 0, "no_targets": 0, "tokens": 0, "target_tokens": 0}
    input_ids, labels = [], []
    for ids, mask in _sft_examples(ds, tokenizer):
        if not completion_only_loss:
            mask = [True] * len(ids)
        if len(ids) > max_seq_length:
            if truncation == "drop":
                stats["dropped"] += 1
                continue
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
            stats["truncated"] += 1
        n_targets = sum(mask[1:])  # the first token is never a target (nothing precedes it)
        if n_targets == 0:
            stats["no_targets"] += 1
            continue
        input_ids.append(ids)
        labels.append([t if m else IGNORE for t, m in zip(ids, mask)])
        stats["tokens"] += len(ids)
        stats["target_tokens"] += n_targets
    if not input_ids:
        raise DataError(f"no SFT example left after tokenization with max_seq_length {max_seq_length} "
                        f"and truncation {truncation!r} ({stats})")
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
        ids, pos = stream[start: start + max_seq_length], positions[start: start + max_seq_length]
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
    stats = {"examples": len(texts), "truncated": 0, "dropped": len(texts) - len(docs),
             "chunks": len(rows["input_ids"]), "tokens": len(stream)}
    return Dataset.from_dict(rows), stats


def tokenize_classify(ds: Dataset, tokenizer, max_seq_length: int, *, truncation: str = "truncate",
                      label_names: list[str] | None = None) -> tuple[Dataset, dict, int]:
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
    stats = {"examples": len(texts), "truncated": 0, "dropped": 0, "num_labels": num_labels,
             "label_names": label_names if isinstance(feature, ClassLabel) or index else None}
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


# ---------------------------------------------------------------------------------------- pack
def pack(ds: Dataset, max_seq_length: int) -> Dataset:
    """Greedily concatenate tokenized samples, in order, into rows of at most max_seq_length tokens.

    Returns Dataset(input_ids, labels, position_ids). position_ids restart at 0 at every sample, which
    is how transformers tells the samples apart (block-diagonal causal mask, or varlen flash
    attention), so attention never crosses samples. The first label of every sample is -100: the
    target of a sample's last token would otherwise be the next sample's first token. Unpacked, that
    first label is never a target either, so packing does not change the loss.
    """
    _check_args(max_seq_length)
    if len(ds) == 0:
        raise DataError("pack: the dataset is empty")
    all_labels = ds["labels"] if "labels" in ds.column_names else ds["input_ids"]
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    cur = {k: [] for k in rows}
    for ids, labels in zip(ds["input_ids"], all_labels):
        ids, labels = ids[:max_seq_length], labels[:max_seq_length]
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > max_seq_length:
            for k in rows:
                rows[k].append(cur[k])
            cur = {k: [] for k in rows}
        cur["input_ids"] += ids
        cur["labels"] += [IGNORE] + list(labels[1:])
        cur["position_ids"] += range(len(ids))
    for k in rows:
        rows[k].append(cur[k])
    return Dataset.from_dict(rows)


# ------------------------------------------------------------------------------------- collate
def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


class DataCollator:
    """List of feature dicts -> dict of tensors, right-padded to the longest row (or a multiple).

    task "lm":        input_ids (B, T) padded with the pad id, labels (B, T) padded with -100, and
                      either attention_mask (B, T) or, for packed rows (features with position_ids),
                      position_ids (B, T) padded with 0 and NO attention_mask. Each 0-position pad
                      token then forms its own one-token sequence in transformers' packed-sequence
                      detection, so real tokens never attend to padding.
    task "classify":  input_ids (B, T), attention_mask (B, T), labels (B,) long.
    """

    def __init__(self, tokenizer=None, task: str = "lm", *, pad_token_id: int | None = None,
                 pad_to_multiple_of: int | None = None):
        if task not in ("lm", "classify"):
            raise DataError(f"collator task {task!r}: valid tasks are lm, classify")
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise DataError("DataCollator needs a pad id: pass a tokenizer with a pad or eos token, or pad_token_id")
        self.task, self.pad_id, self.multiple = task, pad_token_id, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(f["input_ids"]) for f in features]
        length = max(len(x) for x in ids)
        if self.multiple:
            length = -(-length // self.multiple) * self.multiple
        batch = {"input_ids": _pad(ids, length, self.pad_id)}  # (B, T)
        if self.task == "classify":
            batch["attention_mask"] = _pad([[1] * len(x) for x in ids], length, 0)  # (B, T)
            batch["labels"] = torch.tensor([int(f["labels"] if "labels" in f else f["label"]) for f in features],
                                           dtype=torch.long)  # (B,)
            return batch
        batch["labels"] = _pad([list(f.get("labels", f["input_ids"])) for f in features], length, IGNORE)  # (B, T)
        if all("position_ids" in f for f in features):
            batch["position_ids"] = _pad([list(f["position_ids"]) for f in features], length, 0)  # (B, T)
        else:
            batch["attention_mask"] = _pad([[1] * len(x) for x in ids], length, 0)  # (B, T)
        return batch
