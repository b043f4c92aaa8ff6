"""Reward-model data: preference pairs -> (chosen_ids, rejected_ids[, margin]) -> two rows per pair, as TRL 1.16's
RewardTrainer prepares and collates them.

    train, stats = tokenize_reward(ds, tok, max_length=128)                    # chosen_ids, rejected_ids, margin?
    batch = RewardCollator(tok.pad_token_id)([train[i] for i in range(8)])     # (2P, T) rows: chosen, then rejected
    splits = make_reward_pairs(seed=42)                                        # the embedded set (conversational)

Formats (TRL's): prompt / chosen / rejected (explicit prompt: each sequence is prompt + completion) or chosen /
rejected (implicit prompt: whole sequences), standard (text: the tokenizer's eos appended to each completion) or
conversational (message lists rendered with the chat template); or already tokenized (chosen_ids / rejected_ids,
also the legacy chosen_input_ids / rejected_input_ids). An optional `margin` column (a finite number per pair)
enters the loss as -log sigmoid(r_chosen - r_rejected - margin). Pairs whose chosen or rejected sequence is longer
than max_length are left out, as TRL filters them (never truncated: the reward is read at the last token).

Batch (RewardCollator): input_ids / attention_mask (2P, T), right-padded, the P chosen sequences first and their
rejected ones after (TRL's DataCollatorForPreference); labels (2P,): 1 for a chosen row, 0 for a rejected one, IGNORE
for both rows of an eval padding slot (hfpar.objectives.reward counts pairs from it); margin (P,) when the pairs
carry one (no model input: the objective takes it out before the forward).
"""

from __future__ import annotations

import math
import random

import torch
from datasets import Dataset

from hfpar.parallel.labels import IGNORE

from .errors import DataError
from .load import _load_raw
from .preference import check_columns, is_conversational, make_preference
from .synthetic import _sft_sample

EVAL_SPLITS = ("eval", "validation", "valid", "dev", "test")


def _margin(value, index: int) -> float:
    """A pair's margin as a float; DataError naming the value when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(
            f"reward example {index}: margin {value!r} is not a finite number (valid: one int or float per pair, "
            "e.g. 0.5; or no margin column)"
        )
    return float(value)


def _ids(tok, x, index: int, key: str) -> list[int]:
    if isinstance(x, list):
        return list(tok.apply_chat_template(x, tokenize=True, return_dict=True)["input_ids"])
    if not isinstance(x, str):
        raise DataError(f"reward example {index}: {key} is {type(x).__name__}, expected text or a list of messages")
    return list(tok(text=x)["input_ids"])


def tokenize_reward_pair(example: dict, tok, index: int) -> dict:
    """One example -> {chosen_ids, rejected_ids} (TRL 1.16's RewardTrainer tokenize_fn)."""
    if example.get("chosen_ids") is not None and example.get("rejected_ids") is not None:
        return {"chosen_ids": list(example["chosen_ids"]), "rejected_ids": list(example["rejected_ids"])}
    for k in ("chosen", "rejected"):
        if example.get(k) is None:
            raise DataError(f"reward example {index}: missing {k!r} (valid: text or a list of messages)")
    prompt = example.get("prompt")
    conv = is_conversational(example)
    out = {}
    for k in ("chosen", "rejected"):
        seq = example[k]
        if not conv:  # standard text: eos appended to the completion (TRL's add_eos), before the prompt joins it
            eos = tok.eos_token or ""
            seq = seq if not isinstance(seq, str) or seq.endswith(eos) else seq + eos
        if prompt is not None:
            if isinstance(prompt, list) != isinstance(seq, list):
                raise DataError(
                    f"reward example {index}: prompt and {k} must both be text or both be message lists "
                    f"(prompt is {type(prompt).__name__}, {k} is {type(seq).__name__})"
                )
            seq = prompt + seq
        out[f"{k}_ids"] = _ids(tok, seq, index, k)
    return out


def _columns(ds: Dataset, name: str) -> Dataset:
    """TRL's legacy tokenized columns renamed (chosen_input_ids -> chosen_ids); text columns checked."""
    cols = set(ds.column_names)
    if {"chosen_input_ids", "rejected_input_ids"} <= cols and not {"chosen_ids", "rejected_ids"} <= cols:
        ds = ds.rename_columns({"chosen_input_ids": "chosen_ids", "rejected_input_ids": "rejected_ids"})
    if not {"chosen_ids", "rejected_ids"} <= set(ds.column_names):
        check_columns(ds, name)
    return ds


def tokenize_reward(ds: Dataset, tok, max_length: int | None, *, name: str = "train"):
    """-> (Dataset(chosen_ids, rejected_ids[, margin]), stats {"pairs", "filtered_long"}). DataError (one line)
    for a missing column, a non-numeric margin, or a split that max_length empties (more than 90% left out)."""
    ds = _columns(ds, name)
    has_margin = "margin" in ds.column_names
    rows, long = [], 0
    for i, ex in enumerate(ds):
        p = tokenize_reward_pair(dict(ex), tok, i)
        if not p["chosen_ids"] or not p["rejected_ids"]:
            raise DataError(f"reward example {i}: an empty sequence (chosen or rejected has no tokens)")
        if has_margin:
            p["margin"] = _margin(ex["margin"], i)
        if max_length is not None and max(len(p["chosen_ids"]), len(p["rejected_ids"])) > max_length:
            long += 1  # TRL's filter: left out, said by the recipe
            continue
        rows.append(p)
    total = len(rows) + long
    if total == 0:
        raise DataError(f"reward dataset {name}: no examples")
    if len(rows) < 0.1 * total:
        raise DataError(
            f"reward dataset {name}: {long} of {total} pairs have a sequence longer than --max_length {max_length} "
            "and would be left out (more than 90%); raise --max_length"
        )
    return Dataset.from_list(rows), {"pairs": len(rows), "filtered_long": long}


def load_reward_split(args, tok, split: str) -> tuple[Dataset | None, dict]:
    """The reward recipe's tokenized pairs of `split` ("train" | "eval"): --dataset_name's (eval: its eval /
    validation / valid / dev / test split, None without one) or the embedded reward pairs' (make_reward_pairs)."""
    if args.dataset_name is None:
        raw = make_reward_pairs(args.seed)[split]
    else:
        splits = _load_raw(args.dataset_name)
        names = ("train",) if split == "train" else EVAL_SPLITS
        key = next((k for k in names if k in splits), None)
        if key is None and split == "train":
            raise DataError(f"dataset {args.dataset_name}: no train split (have {', '.join(splits)})")
        if key is None:
            return None, {}
        raw = splits[key]
    label = f"{args.dataset_name or 'embedded'}{'' if split == 'train' else ' (eval)'}"
    return tokenize_reward(raw, tok, args.max_length or args.max_seq_length, name=label)


class RewardCollator:
    """Pairs -> {input_ids, attention_mask (2P, T), labels (2P,)[, margin (P,)]} (see the module docstring).
    pad_to_multiple_of: T rounded up to it."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_id, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features]
        length = max(len(s) for s in seqs)
        if self.multiple:
            length = -(-length // self.multiple) * self.multiple
        batch = {
            "input_ids": torch.tensor([s + [self.pad_id] * (length - len(s)) for s in seqs], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs], dtype=torch.long),
        }
        real = [IGNORE if f.get("no_targets") else 1 for f in features]
        batch["labels"] = torch.tensor(real + [IGNORE if r == IGNORE else 0 for r in real], dtype=torch.long)
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([f["margin"] for f in features], dtype=torch.float32)  # (P,)
        return batch


def make_reward_pairs(seed: int = 42, off_task: float = 0.75) -> dict[str, Dataset]:
    """The embedded reward pairs: the dpo recipe's (hfpar.data.preference.make_preference: chosen = the right answer,
    rejected = a plausible wrong one), with the rejected answer of a fraction `off_task` of them replaced by the
    answer to a prompt of the other task (a count for a repeat, letters for a count). A reward model trained from
    scratch learns those within a minute; the plausible wrong answers (an off-by-one count, a wrong letter) take
    far longer (measured: eval accuracy 0.45 -> 0.56 after 150 steps on the dpo pairs alone; with half of them
    off-task, training was unstable and ended between 0.62 and 0.77)."""
    rng = random.Random(f"reward-{seed}")
    out = {}
    for split, ds in make_preference(seed).items():
        rows = []
        for ex in ds:
            if rng.random() < off_task:
                kind = ex["prompt"][-1]["content"].split()[0]
                other = _sft_sample(rng)
                while other[-2]["content"].split()[0] == kind:
                    other = _sft_sample(rng)
                ex = {**ex, "rejected": [{"role": "assistant", "content": other[-1]["content"]}]}
            rows.append(ex)
        out[split] = Dataset.from_list(rows)
    return out


def make_reward_text(seed: int = 42, n: int = 64) -> Dataset:
    """Standard-text pairs with a margin column (the margin: how much the chosen answer should win by), from the
    embedded preference generator: for tests and examples of the text + margin format."""
    rng = random.Random(f"reward-{seed}")
    rows = []
    for ex in make_preference(seed, n_train=n, n_eval=1)["train"]:
        prompt = ex["prompt"][-1]["content"] + "\n"
        rows.append(
            {
                "prompt": prompt,
                "chosen": ex["chosen"][0]["content"],
                "rejected": ex["rejected"][0]["content"],
                "margin": round(rng.uniform(0.0, 1.0), 3),
            }
        )
    return Dataset.from_list(rows)
