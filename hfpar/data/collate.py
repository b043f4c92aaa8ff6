"""Pack tokenized samples into rows, and collate rows into padded tensor batches.

    batch = DataCollator(tokenizer)(pack(train, 128).select(range(8)).to_list())  # + position_ids
    batch = DataCollator(tokenizer, padding_free=True, max_seq_length=128)([train[i] for i in range(8)])

Padding-free collation packs the samples of ONE batch (first-fit decreasing) into as few rows of at most
max_seq_length tokens as they fit in, the way `pack` packs a whole dataset: same samples, same targets,
attention kept inside each sample by the position ids; only the rows' padding is gone.
"""

from __future__ import annotations

import torch
from datasets import Dataset

from .errors import DataError
from .tokenize import IGNORE, _check_args


# ---------------------------------------------------------------------------------------- pack
def greedy_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices in order, a new bin whenever the next length does not fit the current one."""
    bins, used = [], capacity
    for i, n in enumerate(lengths):
        if bins and used + n <= capacity:
            bins[-1].append(i)
            used += n
        else:
            bins.append([i])
            used = n
    return bins


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into as few bins of total length <= capacity as first-fit decreasing finds: longest first,
    each into the first bin with room (a length above capacity gets a bin of its own). Deterministic: equal
    lengths keep their index order."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if b is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[b].append(i)
            room[b] -= lengths[i]
    return bins


def join_rows(features: list[dict]) -> dict[str, list[int]]:
    """Samples or packed rows -> ONE row, in order (DataCollator one_row): each keeps its position ids (a sample's
    restart at 0), and the first label of each is -100, as `join_samples` does: unjoined, nothing precedes it, so
    it is no target either (a packed row's samples already start with -100; a clm row's first token is a target of
    nothing). Same targets, same loss."""
    row = {"input_ids": [], "labels": [], "position_ids": []}
    for f in features:
        ids = list(f["input_ids"])
        row["input_ids"] += ids
        row["labels"] += [IGNORE] + list(f.get("labels", ids))[1:]
        row["position_ids"] += list(f["position_ids"]) if "position_ids" in f else range(len(ids))
    return row


def join_samples(samples: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """(input_ids, labels) samples -> one row. position_ids restart at 0 at every sample, which is how
    transformers tells the samples apart (block-diagonal causal mask, or varlen flash attention), so attention
    never crosses samples. The first label of every sample is -100: the target of a sample's last token would
    otherwise be the next sample's first token. Unpacked, that first label is never a target either (nothing
    precedes it), so packing does not change the loss."""
    return join_rows([{"input_ids": ids, "labels": labels} for ids, labels in samples])


def pack(ds: Dataset, max_seq_length: int) -> Dataset:
    """Greedily concatenate tokenized samples, in order, into rows of at most max_seq_length tokens.

    Returns Dataset(input_ids, labels, position_ids), rows as `join_samples` builds them.
    """
    _check_args(max_seq_length)
    if len(ds) == 0:
        raise DataError("pack: the dataset is empty")
    all_labels = ds["labels"] if "labels" in ds.column_names else ds["input_ids"]
    samples = [(ids[:max_seq_length], labels[:max_seq_length]) for ids, labels in zip(ds["input_ids"], all_labels)]
    rows = [join_samples([samples[i] for i in b]) for b in greedy_bins([len(s[0]) for s in samples], max_seq_length)]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels", "position_ids")})


def pack_batch(features: list[dict], max_seq_length: int) -> list[dict]:
    """One batch's samples -> the fewest rows of at most max_seq_length tokens first-fit decreasing finds."""
    samples = [(list(f["input_ids"]), list(f.get("labels", f["input_ids"]))) for f in features]
    return [
        join_samples([samples[i] for i in b])
        for b in first_fit_decreasing([len(s[0]) for s in samples], max_seq_length)
    ]


# ------------------------------------------------------------------------------------- collate
def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids (B, T) -> bool (B, T), True where a sample starts: at every row start and wherever a position is
    not the previous one + 1 (how transformers' masking_utils.find_packed_sequence_indices tells samples apart)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def sample_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids (B, T) -> the samples' bounds over the B * T tokens flattened, cu_seqlens int32 (N + 1,), on
    position_ids' device (there, finding them is a device-to-host read: nonzero's size)."""
    idx = torch.nonzero(sample_starts(position_ids).reshape(-1)).reshape(-1)
    return torch.cat([idx, idx.new_tensor([position_ids.numel()])]).to(torch.int32)


def flash_kwargs(position_ids: torch.Tensor) -> dict:
    """The samples' bounds over the rows flattened, as transformers' flash kwargs (its DataCollatorWithFlattening
    return_flash_attn_kwargs names): cu_seq_lens_q / _k (int32 (N + 1,)) and max_length_q / _k (ints), computed on
    the host, so that varlen attention needs no device-to-host read of them (hfpar.train.varlen)."""
    cu = sample_bounds(position_ids)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


class DataCollator:
    """List of feature dicts -> dict of tensors, right-padded to the longest row (or a multiple).

    task "lm":        input_ids (B, T) padded with the pad id, labels (B, T) padded with -100, and either
                      attention_mask (B, T), or, for packed rows (features with position_ids, or any batch when
                      padding_free), position_ids (B, T) padded with 0, token_mask (B, T) (1 = real token; not
                      a model input: hfpar.train.batch_plan hands it to MoE routers) and NO attention_mask. Each
                      0-position pad token then forms its own one-token sequence in transformers' packed-sequence
                      detection, so real tokens never attend to padding.
    task "classify":  input_ids (B, T), attention_mask (B, T), labels (B,) long.

    padding_free: pack each batch's samples into rows of at most max_seq_length tokens (`pack_batch`) first;
    rows that are already packed are left as they are.
    one_row (with padding_free): the batch's samples, or its packed rows, joined into ONE row (`join_rows`), for
    attention that skips the pairs between samples (hfpar.data.padding_free.ONE_ROW_ATTENTIONS); the batch then
    also holds the samples' bounds as transformers' flash kwargs (`flash_kwargs`: two ints among the tensors).
    """

    def __init__(
        self,
        tokenizer=None,
        task: str = "lm",
        *,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_free: bool = False,
        max_seq_length: int | None = None,
        one_row: bool = False,
    ):
        if task not in ("lm", "classify"):
            raise DataError(f"collator task {task!r}: valid tasks are lm, classify")
        if padding_free and task != "lm":
            raise DataError(
                f"padding_free with task {task!r}: valid only for task lm (classification reads each "
                "row's last non-pad token)"
            )
        if padding_free and (not isinstance(max_seq_length, int) or max_seq_length < 2):
            raise DataError(
                f"padding_free needs max_seq_length, the longest row to pack into: got {max_seq_length!r}, "
                "expected an integer >= 2"
            )
        if one_row and not padding_free:
            raise DataError("one_row joins padding-free batches into one row: pass padding_free=True with it")
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise DataError("DataCollator needs a pad id: pass a tokenizer with a pad or eos token, or pad_token_id")
        self.task, self.pad_id, self.multiple = task, pad_token_id, pad_to_multiple_of
        self.padding_free, self.max_seq_length, self.one_row = padding_free, max_seq_length, one_row

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        packed = all("position_ids" in f for f in features)
        if self.one_row:
            features, packed = [join_rows(features)], True
        elif self.padding_free and not packed:
            features, packed = pack_batch(features, self.max_seq_length), True
        ids = [list(f["input_ids"]) for f in features]
        length = max(len(x) for x in ids)
        if self.multiple:
            length = -(-length // self.multiple) * self.multiple
        batch = {"input_ids": _pad(ids, length, self.pad_id)}  # (B, T)
        real = _pad([[1] * len(x) for x in ids], length, 0)  # (B, T) 1 = real token
        if self.task == "classify":
            batch["attention_mask"] = real
            batch["labels"] = torch.tensor(
                [int(f["labels"] if "labels" in f else f["label"]) for f in features], dtype=torch.long
            )  # (B,)
            return batch
        batch["labels"] = _pad([list(f.get("labels", f["input_ids"])) for f in features], length, IGNORE)  # (B, T)
        if packed:
            batch["position_ids"] = _pad([list(f["position_ids"]) for f in features], length, 0)  # (B, T)
            batch["token_mask"] = real
        else:
            batch["attention_mask"] = real
        if self.one_row:  # model inputs too: attention that takes them (varlen kernels) reads no device tensor
            batch.update(flash_kwargs(batch["position_ids"]))
        return batch
