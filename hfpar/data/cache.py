"""Tokenized datasets cached on disk, so a relaunch (another strategy, another seed, a resumed job) and every
rank after the first read the tokenized rows instead of tokenizing again.

    ds, stats = cached(tokenize_sft, splits["train"], tok, 128, completion_only_loss=True)   # same as the call
    ds, stats, num_labels = cached(tokenize_classify, splits["train"], tok, 64)

The key follows the same idea as `datasets`' own cache (why: docs/architecture.md#why-loading-data-and-the-planner):
the input dataset's fingerprint (datasets derives it from file contents / the in-memory table and every transform),
the tokenizer's full serialized state (vocabulary, normalizer, added and special tokens, chat template), the function,
its arguments, and the source of the tokenizing code (so editing hfpar's tokenizers never reads a stale entry).

Where: `<HF_DATASETS_CACHE>/hfpar_tokenized/<key>/` (the directory `datasets` uses for its own cache). Off when
`datasets.disable_caching()` was called, or with HFPAR_TOKENIZED_CACHE=0; a slow (Python) tokenizer is never
cached (no complete serialized state to key it by). Entries are written to a temporary directory and renamed, so
concurrent writers (ranks, parallel jobs) never expose a half-written entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import datasets
from datasets import Dataset

from . import chat, tokenize

logger = logging.getLogger(__name__)

_VERSION = "1"
_SOURCE = hashlib.sha256((inspect.getsource(tokenize) + inspect.getsource(chat)).encode()).hexdigest()


def cache_root() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "hfpar_tokenized"


def enabled() -> bool:
    return datasets.is_caching_enabled() and os.environ.get("HFPAR_TOKENIZED_CACHE", "1") != "0"


def tokenizer_state(tokenizer) -> str | None:
    """Everything that decides the tokenizer's output, as one string; None for slow tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return json.dumps(
        {
            "class": type(tokenizer).__name__,
            "backend": backend.to_str(),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "bos": getattr(tokenizer, "add_bos_token", None),
            "eos": getattr(tokenizer, "add_eos_token", None),
        },
        sort_keys=True,
    )


def cache_key(fn, ds: Dataset, tokenizer, args: tuple, kwargs: dict) -> str | None:
    fingerprint = getattr(ds, "_fingerprint", None)
    state = tokenizer_state(tokenizer)
    if fingerprint is None or state is None:
        return None
    parts = [
        _VERSION,
        _SOURCE,
        fn.__name__,
        fingerprint,
        hashlib.sha256(state.encode()).hexdigest(),
        json.dumps([list(args), sorted(kwargs.items())], default=str),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def cached(fn, ds: Dataset, tokenizer, *args, **kwargs):
    """fn(ds, tokenizer, *args, **kwargs) -> (Dataset, *json-able extras), read from the cache when an entry for
    exactly these inputs exists, else computed and stored. Errors of fn (DataError) are never cached."""
    key = cache_key(fn, ds, tokenizer, args, kwargs) if enabled() else None
    if key is None:
        return fn(ds, tokenizer, *args, **kwargs)
    entry = cache_root() / key
    if (entry / "extras.json").is_file():
        try:
            return (Dataset.load_from_disk(str(entry / "rows")), *json.loads((entry / "extras.json").read_text()))
        except (OSError, ValueError) as exc:  # a damaged entry: recompute (and replace it below)
            logger.warning("tokenized cache entry %s unreadable (%s); tokenizing again", entry, exc)
    out = fn(ds, tokenizer, *args, **kwargs)
    _store(entry, out[0], list(out[1:]))
    return out


def _store(entry: Path, rows: Dataset, extras: list) -> None:
    tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}")
    bars = not datasets.utils.are_progress_bars_disabled()
    try:
        datasets.utils.disable_progress_bars()  # a cache write is not work the user asked for: no bar
        rows.save_to_disk(str(tmp / "rows"))
        (tmp / "extras.json").write_text(json.dumps(extras))
        if entry.exists():  # an unreadable entry (above): replace it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / "extras.json").is_file():  # not just another process having written it meanwhile
                raise
    except OSError as exc:  # a read-only or full cache directory costs a re-tokenization, nothing more
        logger.warning("could not write the tokenized cache entry %s: %s", entry, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            datasets.utils.enable_progress_bars()
