"""Preference pairs in TRL's formats tokenized into (prompt_ids, chosen_ids, rejected_ids), and the labels that carry
their pair.

    train, stats = tokenize_preference(splits["train"], tok, max_length=128)
    labels = encode_targets(token, row, side); token, seq, valid = decode_targets(labels)

The formats, truncation and row layout: hfpar/data/preference.py's docstring.
"""

from __future__ import annotations

import torch
from datasets import Dataset

from .errors import DataError

_STRIDE = 1 << 32  # token ids below it (any vocabulary); (2 * row + side + 1) * _STRIDE above


def encode_targets(token, row, side):
    """A completion label carrying its pair: token + (2 * row + side + 1) * 2^32 (side 0 chosen, 1 rejected); works on
    ints and tensors alike."""
    return token + (2 * row + side + 1) * _STRIDE


def decode_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """labels (..., ) -> (token, sequence, valid): sequence = 2 * row + side of the batch, token IGNORE-free
    (0 where not valid)."""
    valid = labels >= _STRIDE
    seq = torch.where(valid, labels // _STRIDE - 1, 0)
    token = torch.where(valid, labels % _STRIDE, 0)
    return token, seq, valid


COLUMNS = ("prompt", "chosen", "rejected")


def is_conversational(example: dict) -> bool:
    """As trl.data_utils.is_conversational for prompt / chosen / rejected."""
    v = next((example[k] for k in COLUMNS if k in example), None)
    return isinstance(v, list) and len(v) > 0 and isinstance(v[0], dict) and "role" in v[0]


def extract_prompt(example: dict) -> dict:
    """As trl.data_utils.extract_prompt: the longest common prefix of chosen and rejected (whole messages for
    conversational data; for text, cut at the last whitespace before they differ)."""
    c, r = example["chosen"], example["rejected"]
    n = 0
    for n in range(min(len(c), len(r))):
        if c[n] != r[n]:
            break
    else:
        n = min(len(c), len(r))
    if isinstance(c, str) and n > 0:  # TRL: back off to the last space so no word is split
        while n > 0 and c[n - 1] != " ":
            n -= 1
        n = max(n - 1, 0) if n > 0 else 0
    return {"prompt": c[:n], "chosen": c[n:], "rejected": r[n:]}


def check_columns(ds: Dataset, name: str) -> None:
    cols = set(ds.column_names)
    missing = [c for c in ("chosen", "rejected") if c not in cols]
    if missing:
        raise DataError(
            f"preference dataset {name}: no {' / '.join(missing)} column (have {', '.join(sorted(cols))}); "
            "expected prompt / chosen / rejected (standard or conversational) or chosen / rejected"
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids(tok, x) -> list[int]:
    if isinstance(x, list):
        return list(tok.apply_chat_template(x, tokenize=True, return_dict=True)["input_ids"])
    return list(tok(text=x)["input_ids"])


def tokenize_pair(example: dict, tok, index: int) -> dict:
    """One example -> prompt_ids, chosen_ids, rejected_ids (TRL 1.16's tokenize_fn)."""
    for k in ("chosen", "rejected"):
        v = example.get(k)
        if v is None or (isinstance(v, (str, list)) and len(v) == 0):
            raise DataError(f"preference example {index}: empty or missing {k!r}")
    if "prompt" not in example or example["prompt"] is None:
        example = extract_prompt(example)
        if not example["chosen"] or not example["rejected"]:
            raise DataError(f"preference example {index}: chosen and rejected are identical after the common prompt")
    conv = is_conversational(example)
    if conv:
        prompt = list(
            tok.apply_chat_template(example["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
        pc = _ids(tok, example["prompt"] + example["chosen"])
        pr = _ids(tok, example["prompt"] + example["rejected"])
    else:
        eos = tok.eos_token or ""
        c, r = example["chosen"], example["rejected"]
        c, r = c if c.endswith(eos) else c + eos, r if r.endswith(eos) else r + eos
        prompt, pc, pr = (
            _ids(tok, example["prompt"]),
            _ids(tok, example["prompt"] + c),
            _ids(tok, example["prompt"] + r),
        )
    n = min(_common_prefix(prompt, pc), _common_prefix(prompt, pr))
    out = {"prompt_ids": prompt[:n], "chosen_ids": pc[n:], "rejected_ids": pr[n:]}
    for k in ("chosen_ids", "rejected_ids"):
        if not out[k]:
            raise DataError(f"preference example {index}: the {k[:-4]} completion has no tokens")
    return out


def truncate_pair(
    p: dict,
    *,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
) -> dict:
    """-> {"chosen": (ids, completion_mask), "rejected": (...)}: each sequence prompt + completion, truncated."""
    prompt = p["prompt_ids"][-max_prompt_length:] if max_prompt_length else p["prompt_ids"]
    out = {}
    for side in ("chosen", "rejected"):
        comp = p[f"{side}_ids"][:max_completion_length] if max_completion_length else p[f"{side}_ids"]
        ids, mask = prompt + comp, [0] * len(prompt) + [1] * len(comp)
        if max_length is not None:
            sl = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[sl], mask[sl]
        out[side] = (ids, mask)
    return out


def tokenize_preference(
    ds: Dataset,
    tok,
    max_length: int | None,
    *,
    truncation_mode: str = "keep_start",
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    truncation: str = "truncate",
    name: str = "train",
) -> tuple[Dataset, dict]:
    """Tokenized pairs (prompt_ids, chosen_ids, rejected_ids and, when present, ref_chosen_logps /
    ref_rejected_logps); truncation "drop": a pair longer than the limits is refused, naming the example."""
    check_columns(ds, name)
    if truncation_mode not in ("keep_start", "keep_end"):
        raise DataError(f"--truncation_mode {truncation_mode!r}: valid values are keep_start, keep_end")
    rows, cut = [], 0
    for i, ex in enumerate(ds):
        p = tokenize_pair(dict(ex), tok, i)
        if max_length is not None and truncation_mode == "keep_start" and len(p["prompt_ids"]) >= max_length:
            raise DataError(
                f"preference example {i}: its prompt alone has {len(p['prompt_ids'])} tokens, "
                f"--max_length {max_length} leaves no completion token (raise --max_length)"
            )
        if not p["prompt_ids"] and min(len(p["chosen_ids"]), len(p["rejected_ids"])) < 2:
            raise DataError(
                f"preference example {i}: no prompt and a one-token completion: nothing precedes its "
                "token, so it has no target"
            )
        lens = [len(p["prompt_ids"]) + len(p[k]) for k in ("chosen_ids", "rejected_ids")]
        long = max_length is not None and max(lens) > max_length
        if long and truncation == "drop":
            raise DataError(
                f"preference example {i}: prompt + completion has {max(lens)} tokens, over --max_length "
                f"{max_length} (--truncation truncate cuts it as TRL does)"
            )
        cut += long
        for k in ("ref_chosen_logps", "ref_rejected_logps"):
            if k in ex:
                p[k] = float(ex[k])
        rows.append(p)
    if not rows:
        raise DataError(f"preference dataset {name}: no examples")
    return Dataset.from_list(rows), {"pairs": len(rows), "truncated": cut}
