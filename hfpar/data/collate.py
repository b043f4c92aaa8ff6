"""Pack tokenized samples into rows, and collate rows into padded tensor batches.

    batch = DataCollator(tokenizer)(pack(train, 128).select(range(8)).to_list())  # + position_ids
"""

from __future__ import annotations

import torch
from datasets import Dataset

from .errors import DataError
from .tokenize import IGNORE, _check_args


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
