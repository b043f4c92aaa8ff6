"""Prompt-only datasets for online RL (GRPO): TRL 1.16 GRPOTrainer's formats, tokenized once, checked before the model
loads.

    train, evals, stats = load_prompts(args, tokenizer)   # args: dataset_name, max_prompt_length, seed, eval_steps, ...
    row = train[0]          # {"prompt": str | [messages], "prompt_ids": [int], "answer": ..., <other columns>}
    ids, mask = left_pad([train[i]["prompt_ids"] for i in range(4)], tokenizer.pad_token_id)   # (B, P), (B, P)
    kwargs = train.column_values([0, 1, 2, 3])          # {"answer": [...], ...}: the reward functions' extra kwargs

Formats (TRL's): a `prompt` column holding a string (standard: tokenized as `tokenizer(text=prompts)`, special tokens
as the tokenizer adds them, e.g. bos) or a list of {"role", "content"} messages (conversational: the tokenizer's chat
template with add_generation_prompt=True, tokenize=True, as TRL's `_tokenize_prompts`). Every other column is kept and
passed to the reward functions as keyword arguments, one value per completion (TRL leaves out `completion` and
`completion_ids`, and so does `.columns`). dataset_name None is the embedded task (hfpar/data/grpo_task.py); a file,
a directory or a hub id loads as hfpar.data.load_splits does (train* / eval* files, or the hub's splits).

hfpar refuses what TRL would cut or crash on, in one line (DataError) before the model loads: a prompt longer than
--max_prompt_length tokens (TRL truncates it silently), no `prompt` column, an empty prompt, a column whose name is a
reward function's own argument (prompts, completions, completion_ids, trainer_state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import Dataset

from .chat import _check_messages
from .errors import DataError, _one_line
from .grpo_task import make_grpo_task
from .load import _carve_eval, _load_raw, _pick_splits

EMBEDDED_TASK = "hfpar-grpo-task"  # stats["dataset"] when dataset_name is None
NOT_PASSED = ("completion", "completion_ids")  # TRL does not pass these columns to reward functions
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")  # reward functions' own arguments


@dataclass
class PromptSet:
    """Prompts (as given), their token ids, and the extra columns. `set[i]` -> dict; `.columns` -> extra names."""

    prompts: list
    prompt_ids: list[list[int]]
    extra: dict[str, list] = field(default_factory=dict)
    conversational: bool = False

    @property
    def columns(self) -> list[str]:
        """The extra columns passed to reward functions (every column but prompt, completion, completion_ids)."""
        return [c for c in self.extra if c not in NOT_PASSED]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        row = {"prompt": self.prompts[i], "prompt_ids": self.prompt_ids[i]}
        row.update({c: v[i] for c, v in self.extra.items()})
        return row

    def column_values(self, indices: list[int]) -> dict[str, list]:
        """{column: [value of each index]} for the reward functions (repeat indices to repeat a prompt's group)."""
        return {c: [self.extra[c][i] for i in indices] for c in self.columns}


def load_prompts(args, tokenizer) -> tuple[PromptSet, PromptSet | None, dict]:
    """-> (train, eval or None, stats). args: dataset_name (None = embedded task), max_prompt_length (int | None),
    seed, eval_steps (0: no eval set; None: evaluated at the end), max_eval_samples (optional, None = all),
    eval_split_fraction (optional)."""
    name = getattr(args, "dataset_name", None)
    seed = getattr(args, "seed", 42)
    limit = getattr(args, "max_prompt_length", None)
    want_eval = getattr(args, "eval_steps", 0) != 0
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"--max_prompt_length {limit!r}: must be a positive integer or None")
    if name is None:
        splits = make_grpo_task(seed)
        train, evals, label = splits["train"], splits["eval"], EMBEDDED_TASK
    else:
        train, evals = _pick_splits(_load_raw(name), name)
        label = name
        if len(train) == 0:
            raise DataError(f"dataset {name}: the train split is empty")
        _check_columns(train, name)
        if evals is not None:
            _check_columns(evals, name)
        elif want_eval:
            train, evals = _carve_eval(train, getattr(args, "eval_split_fraction", 0.05), seed, name)
    if not want_eval:
        evals = None
    max_eval = getattr(args, "max_eval_samples", None)
    if evals is not None and max_eval is not None and max_eval < len(evals):
        evals = evals.select(range(max_eval))
    train_set = tokenize_prompts(train, tokenizer, limit, f"dataset {label} (train)")
    eval_set = tokenize_prompts(evals, tokenizer, limit, f"dataset {label} (eval)") if evals is not None else None
    lengths = [len(ids) for s in (train_set, eval_set) if s is not None for ids in s.prompt_ids]
    stats = {
        "dataset": label,
        "format": "conversational" if train_set.conversational else "standard",
        "train_prompts": len(train_set),
        "eval_prompts": len(eval_set) if eval_set is not None else 0,
        "columns": train_set.columns,
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_mean": round(sum(lengths) / len(lengths), 2),
        "max_prompt_length": limit,
    }
    return train_set, eval_set, stats


def _check_columns(ds: Dataset, name: str) -> None:
    cols = ds.column_names
    if "prompt" not in cols:
        raise DataError(
            f"dataset {name}: no 'prompt' column (found {', '.join(sorted(cols)) or 'none'}); GRPO expects a "
            "prompt column (a string or a list of messages), plus any columns the reward functions read"
        )
    clash = [c for c in cols if c in RESERVED and c not in NOT_PASSED]
    if clash:
        raise DataError(
            f"dataset {name}: column {clash[0]!r} has the name of a reward function argument "
            f"({', '.join(RESERVED)}); rename it"
        )


def tokenize_prompts(ds: Dataset, tokenizer, max_prompt_length: int | None = None, name: str = "dataset") -> PromptSet:
    """A Dataset with a `prompt` column -> PromptSet (TRL 1.16's prompt tokenization); DataError on a bad prompt."""
    _check_columns(ds, name)
    prompts = list(ds["prompt"])  # datasets 5 returns a lazy Column
    if len(prompts) == 0:
        raise DataError(f"{name}: no prompts")
    conversational = _is_conversational(prompts[0])
    for i, p in enumerate(prompts):
        _check_prompt(p, i, conversational, name)
    if conversational:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{name}: conversational prompts need a chat template, and tokenizer "
                f"{tokenizer.name_or_path!r} has none; give standard (string) prompts or a tokenizer with one"
            )
        from jinja2 import TemplateError  # lazy, as in chat.py

        try:
            ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
        except TemplateError as exc:
            raise DataError(f"{name}: the chat template failed: {_one_line(exc)}") from None
        prompt_ids = [list(x) for x in ids["input_ids"]]
    else:
        prompt_ids = [list(x) for x in tokenizer(text=prompts)["input_ids"]]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise DataError(f"{name}: example {i}: the prompt has no tokens")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise DataError(
                f"{name}: example {i}: the prompt is {len(ids)} tokens, longer than --max_prompt_length "
                f"{max_prompt_length}; raise the limit or shorten / filter the prompt (hfpar does not truncate)"
            )
    extra = {c: list(ds[c]) for c in ds.column_names if c != "prompt"}
    return PromptSet(prompts, prompt_ids, extra, conversational)


def _is_conversational(prompt) -> bool:
    """As trl.data_utils.is_conversational: a list whose first item is a dict with a role."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def _check_prompt(prompt, index: int, conversational: bool, name: str) -> None:
    if conversational:
        if not _is_conversational(prompt):
            raise DataError(
                f"{name}: example {index}: prompt {_short(prompt)} is not a list of messages, while example 0's "
                "is; keep one format per dataset"
            )
        try:
            _check_messages(prompt, index)
        except DataError as exc:
            raise DataError(f"{name}: {exc}") from None
        if not any(m["content"].strip() for m in prompt):
            raise DataError(f"{name}: example {index}: the prompt is empty (every message's content is blank)")
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{name}: example {index}: the prompt is empty")
    elif isinstance(prompt, list) and not prompt:
        raise DataError(f"{name}: example {index}: the prompt is empty (no messages)")
    else:
        raise DataError(
            f"{name}: example {index}: prompt {_short(prompt)} is neither a string nor a list of "
            "{role, content} messages"
        )


def _short(value, n: int = 60) -> str:
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def left_pad(prompt_ids_list: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (ids (B, P) LongTensor left-padded with pad_id, mask (B, P) LongTensor: 1 on real tokens), P the
    longest prompt: the layout `generate` (hfpar.rollout.sampling.sample) takes."""
    if not prompt_ids_list:
        raise ValueError("left_pad: no prompts")
    width = max(len(p) for p in prompt_ids_list)
    ids = torch.full((len(prompt_ids_list), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(prompt_ids_list), width), dtype=torch.long)  # (B, P)
    for r, p in enumerate(prompt_ids_list):
        if p:
            ids[r, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
    return ids, mask
