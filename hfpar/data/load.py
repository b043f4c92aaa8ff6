"""Load: the tokenizer, and a DatasetDict(train, eval) from the embedded generator, local files or the hub.

splits = load_splits("my_data/", "sft")  # train*/eval* files by name, else eval carved from train (5 %)
"""

from __future__ import annotations

import json
import logging
import os
import re
from importlib import resources
from pathlib import Path

import datasets
import torch
from datasets import ClassLabel, Dataset, DatasetDict

from hfpar.data.synthetic import embedded_splits
from hfpar.loading.contained import escape_problems

from .errors import DataError, _one_line

logger = logging.getLogger(__name__)

EMBEDDED = "hfpar-tiny"
EMBEDDED_VLM = "hfpar-tiny-vlm"  # the embedded tiny vision-language model (Idefics3, hfpar/assets/tiny_vlm)
EMBEDDED_MODELS = {EMBEDDED: "tiny", EMBEDDED_VLM: "tiny_vlm"}  # name -> its directory under hfpar/assets
KINDS = ("sft", "clm", "classify")
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
EVAL_NAMES = ("eval", "validation", "valid", "dev", "test")
# Suffixes that mark a name as a (missing) file rather than a hub id.
FILE_LIKE = set(BUILDERS) | {".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".zst", ".bz2", ".xz", ".ndjson", ".pq"}


# ------------------------------------------------------------------------------------- tokenizer
def embedded_model_path(name: str = EMBEDDED) -> str:
    """Directory of an embedded model's config + tokenizer (inside the installed package): the tiny Llama, or
    (EMBEDDED_VLM) the tiny Idefics3 with its processor."""
    return str(resources.files("hfpar") / "assets" / EMBEDDED_MODELS[name])


def load_tokenizer(name_or_path: str | None = None, trust_remote_code: bool = False):
    """None or "hfpar-tiny" -> the embedded tokenizer, else AutoTokenizer.from_pretrained. Always has a pad token."""
    # lazy: +0.8 s (measured), paid by paths that import hfpar.data but load no tokenizer (recipe argument errors)
    from transformers import AutoTokenizer

    path = embedded_model_path(name_or_path or EMBEDDED) if name_or_path in (None, *EMBEDDED_MODELS) else name_or_path
    try:  # an untrusted file: whatever its parser raises (tokenizers' own Exception, RecursionError) is one line
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise DataError(
            f"tokenizer {name_or_path!r} could not be loaded: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"tokenizer {name_or_path!r} has neither a pad nor an eos token; give one that has")
        tok.pad_token = tok.eos_token
        logger.warning("tokenizer %s has no pad token; using eos %r as pad", name_or_path, tok.eos_token)
    return tok


# ------------------------------------------------------------------------------------------ load
def load_splits(
    dataset_name: str | None, kind: str, *, eval_split_fraction: float = 0.05, seed: int = 42
) -> DatasetDict:
    """DatasetDict(train, eval) for a recipe kind, from the embedded generator, local files or the hub."""
    if kind not in KINDS:
        raise DataError(f"dataset kind {kind!r}: valid kinds are {', '.join(KINDS)}")
    if dataset_name is None:
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
    path = Path(name).expanduser()
    if path.is_dir():
        for problem in escape_problems(name, option="dataset", walk=True):  # a file of it linking out: never read
            raise DataError(problem)
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
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or os.sep != "/"
        and os.sep in name
        or Path(name).suffix.lower() in FILE_LIKE
    )


def _builder_of(path: Path) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"dataset file {path}: unsupported extension {path.suffix or '(none)'!r}; valid: {', '.join(BUILDERS)}"
        )
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
            raise DataError(
                f"dataset file {path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        except RecursionError:
            raise DataError(f"dataset file {path}: nested too deeply to be a dataset") from None
        if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
            raise DataError(
                f"dataset file {path}: expected a list of objects or JSON Lines, got a "
                f"{type(obj).__name__}{' holding non-objects' if isinstance(obj, list) else ''}"
            )
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"dataset file {path}: malformed JSON Lines at line {lineno}: {exc.msg}") from None
        except RecursionError:  # an untrusted file: [[[[...]]]] exhausts the parser's stack
            raise DataError(f"dataset file {path}: line {lineno} is nested too deeply to be an example") from None
        if not isinstance(obj, dict):
            raise DataError(f"dataset file {path}: line {lineno} is not a JSON object")


def _is_json_lines(text: str) -> bool:
    """A .json file may hold JSON Lines: its first line is then a whole JSON object."""
    try:
        return isinstance(json.loads(text.lstrip().splitlines()[0]), dict)
    except (json.JSONDecodeError, RecursionError):
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
        raise DataError(
            f"dataset {name}: {n} row(s) are too few to carve an eval split from; give at least 2 rows or an eval split"
        )
    n_eval = min(n - 1, max(1, round(n * fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return train.select(sorted(perm[n_eval:])), train.select(sorted(perm[:n_eval]))


FORMATS = {"sft": "messages, or prompt + completion, or text", "clm": "text", "classify": "text + label"}


def _check_columns(ds: Dataset, kind: str, name: str) -> None:
    cols = set(ds.column_names)
    ok = {
        "sft": "messages" in cols or {"prompt", "completion"} <= cols or "text" in cols,
        "clm": "text" in cols,
        "classify": "text" in cols and bool({"label", "labels"} & cols),
    }[kind]
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
