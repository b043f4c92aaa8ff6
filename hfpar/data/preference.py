"""Preference data (DPO): TRL's formats -> (prompt_ids, chosen_ids, rejected_ids) -> one row per pair.

    splits = make_preference(seed=42)                           # the embedded set (conversational, explicit prompt)
    train, stats = tokenize_preference(splits["train"], tok, max_length=128)
    batch = PairCollator(tok)([train[i] for i in range(8)])      # input_ids, labels, position_ids, token_mask
    with_attention_mask(batch)                                   # share_prompt: pair_layout -> its (B, 1, T, T) mask

Formats (TRL's): columns prompt / chosen / rejected, standard (strings) or conversational (lists of
{"role", "content"} messages), or chosen / rejected only (implicit prompt: their longest common prefix, as
trl.data_utils.extract_prompt). Tokenized as TRL 1.16's DPOTrainer._prepare_dataset does: standard text gets
the eos appended to each completion; the completion starts where the tokenized prompt and prompt + completion
first differ. Truncation: --max_prompt_length keeps the prompt's end and --max_completion_length the
completion's start (TRL <= 0.x's per-part limits); then --max_length cuts prompt + completion (TRL 1.16's
DataCollatorForPreference: keep_start, or keep_end). A prompt that fills max_length alone (keep_start) is
refused (TRL drops it silently).

Row layout: each pair is ONE row, its two sequences packed as documents (position ids restart at 0 at the
rejected one): the chosen and rejected sequences of a pair always travel together, through context-parallel
shards and pipeline micro-batches alike (with a shared prompt, several pairs share a row: PairCollator).
Labels carry the pair with each target (encode_targets): pair index in the batch, side (chosen / rejected) and
token, IGNORE outside completions; so every cut of a batch keeps each target next to its pair.
why: docs/architecture.md#why-loading-data-and-the-planner
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from hfpar.data.synthetic import LETTERS, _sft_sample

from .errors import DataError
from .load import _load_raw

# re-exported: the pieces of the pipeline, one module each
from .preference_collate import PairCollator, pair_attention_mask, with_attention_mask
from .preference_tokenize import (
    COLUMNS,
    check_columns,
    decode_targets,
    encode_targets,
    extract_prompt,
    is_conversational,
    tokenize_pair,
    tokenize_preference,
    truncate_pair,
)

__all__ = [
    "COLUMNS",
    "PairCollator",
    "check_columns",
    "decode_targets",
    "encode_targets",
    "extract_prompt",
    "is_conversational",
    "load_preference",
    "load_preference_eval",
    "make_preference",
    "pair_attention_mask",
    "pair_collator",
    "tokenize_pair",
    "tokenize_preference",
    "truncate_pair",
    "with_attention_mask",
]

N_TRAIN, N_EVAL = 2000, 100


# ------------------------------------------------------------------------------------ embedded set
def _wrong_answer(user: str, rng: random.Random) -> str:
    """A plausible wrong answer to the synthetic sft task: off by one at an end, a skipped number, or the wrong
    letter / count."""
    words = user.split()
    if words[0] == "count":
        a, b = int(words[1]), int(words[3])
        nums = list(range(a, b + 1))
        choice = rng.randrange(3)
        if choice == 0 or len(nums) < 3:
            nums = nums + [b + 1] if rng.random() < 0.5 or len(nums) == 1 else nums[:-1]
        elif choice == 1:
            del nums[rng.randrange(1, len(nums) - 1)]
        else:
            nums = [a + 1] + nums[1:] if rng.random() < 0.5 else nums[:1] + [n + 1 for n in nums[1:]]
        return " ".join(str(n) for n in nums)
    ch, n = words[1], int(words[2])
    if rng.random() < 0.5:
        return ch * (n + 1 if n == 1 or rng.random() < 0.5 else n - 1)
    return rng.choice([c for c in LETTERS if c != ch]) * n


def _pair(rng: random.Random) -> dict:
    messages = _sft_sample(rng)
    right = messages[-1]["content"]
    wrong = _wrong_answer(messages[-2]["content"], rng)
    return {
        "prompt": messages[:-1],
        "chosen": [{"role": "assistant", "content": right}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def make_preference(seed: int = 42, n_train: int = N_TRAIN, n_eval: int = N_EVAL) -> DatasetDict:
    """Pairs from the sft generator's tasks: chosen = the right answer, rejected = a plausible wrong one. Eval prompts
    do not occur in train."""
    rng = random.Random(f"dpo-{seed}")
    ev, seen = [], set()
    while len(ev) < n_eval:
        p = _pair(rng)
        key = p["prompt"][-1]["content"]
        if key not in seen:
            seen.add(key)
            ev.append(p)
    tr = []
    while len(tr) < n_train:
        p = _pair(rng)
        if p["prompt"][-1]["content"] not in seen:
            tr.append(p)
    return DatasetDict(train=Dataset.from_list(tr), eval=Dataset.from_list(ev))


# ------------------------------------------------------------------------------------ the recipe's
def load_preference(args, tokenizer) -> tuple[Dataset, dict]:
    """The dpo recipe's tokenized train pairs: --dataset_name (a file, directory or hub id; its train split) or the
    embedded set."""
    if args.dataset_name is None:
        raw = make_preference(args.seed)["train"]
    else:
        splits = _load_raw(args.dataset_name)
        if "train" not in splits:
            raise DataError(f"dataset {args.dataset_name}: no train split (have {', '.join(splits)})")
        raw = splits["train"]
    return tokenize_preference(
        raw,
        tokenizer,
        args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        truncation=args.truncation,
        name=args.dataset_name or "embedded",
    )


def load_preference_eval(args, tokenizer) -> Dataset | None:
    """The dpo recipe's tokenized eval pairs: the embedded set's eval split, or --dataset_name's eval / test /
    validation (valid, dev) split (None without one: the recipe then trains without evaluation)."""
    if args.dataset_name is None:
        raw = make_preference(args.seed)["eval"]
    else:
        splits = _load_raw(args.dataset_name)
        name = next((k for k in ("eval", "validation", "valid", "dev", "test") if k in splits), None)
        if name is None:
            return None
        raw = splits[name]
    ds, _ = tokenize_preference(
        raw,
        tokenizer,
        args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        truncation=args.truncation,
        name=f"{args.dataset_name or 'embedded'} (eval)",
    )
    return ds


def pair_collator(
    args, tokenizer, seq_multiple: int = 1, share_prompt: bool = False, pack: bool | None = None
) -> PairCollator:
    return PairCollator(
        tokenizer,
        max_length=args.max_length or args.max_seq_length,
        truncation_mode=args.truncation_mode,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
        pad_to_multiple_of=seq_multiple if seq_multiple > 1 else None,
        share_prompt=share_prompt,
        pack=pack,
    )
