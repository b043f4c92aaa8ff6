"""The embedded GRPO task: "repeat <letter> <n>" -> the letter n times, a prompt-only dataset with a checkable answer.

    from hfpar.data.grpo_task import make_grpo_task, sft_examples
    splits = make_grpo_task(seed=42)   # DatasetDict(train=508 rows, eval=64 rows): prompt (messages), answer (str)
    splits["train"][0]                 # {"prompt": [{"role": "user", "content": "repeat l 3"}], "answer": "lll"}
    sft = sft_examples(splits["train"])   # prompt / completion (conversational): the warm start's SFT data

Every prompt of the task: a letter of a-z / A-Z and a count n of 2..12, so 52 x 11 = 572 prompts and answers of 2-12
characters (the embedded char-level tokenizer: one token each, + eos, within 16 new tokens). Conversational prompts
(one user message): the embedded tokenizer's chat template ends the assistant turn with eos, so a completion stops
where its answer stops and `exact_match` (hfpar.rollout.rewards) checks it as is (TRL passes conversational
completions as [{"role": "assistant", "content": text}]); and it is TRL's most common GRPO format.

Why this task: after the warm start (scripts/make_grpo_start.py: ~120 SFT steps of the embedded tiny model on the
train prompts) the model greedily answers most eval prompts right but, sampled at temperature 1.0, only about 30 %
of the time; the errors (a letter too many or too few, another letter) differ from sample to sample, so nearly every
prompt's group of 8 holds right and wrong answers, which is the signal GRPO learns from, and its reward can rise
toward the greedy accuracy. Measured (hfpar/assets/grpo_start/warm_start.json, 64 eval prompts x 8 samples): greedy
0.86, sampled 0.31, 83 % of the prompts with a mixed group; the greedy misses are one letter short at n = 3-4. A minimal
on-policy GRPO loop (8 prompts x 8 samples a step, exact_match, group-normalized advantages, token-mean loss, AdamW,
clip 1.0, one thread) raised the train reward 0.30 -> 0.62 in 80 steps at lr 2e-4 (0.34 -> 0.53 in 60 at 1e-4); at
lr 1e-3 it collapsed to empty completions within 15 steps.

Train and eval are disjoint, and the split does not depend on the seed (the eval prompts stay unseen by the shipped
warm start whatever --seed a run uses): 64 eval prompts drawn by a fixed generator, the other 508 for train, in an
order shuffled by the seed. The same seed gives the same data.
"""

from __future__ import annotations

import random
import string

from datasets import Dataset, DatasetDict

LETTERS = string.ascii_lowercase + string.ascii_uppercase
COUNTS = range(2, 13)
N_EVAL = 64
SPLIT_SEED = "grpo-task-split"  # fixed: the shipped warm start never saw an eval prompt


def all_prompts() -> list[tuple[str, str]]:
    """Every (request, answer) of the task, in a fixed order."""
    return [(f"repeat {ch} {n}", ch * n) for ch in LETTERS for n in COUNTS]


def _rows(pairs: list[tuple[str, str]]) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q, _ in pairs], "answer": [a for _, a in pairs]}
    )


def make_grpo_task(seed: int = 42, n_eval: int = N_EVAL) -> DatasetDict:
    """DatasetDict(train, eval) of prompt (one user message) + answer; eval fixed, train ordered by the seed."""
    pairs = all_prompts()
    random.Random(SPLIT_SEED).shuffle(pairs)
    evals, train = pairs[:n_eval], pairs[n_eval:]
    random.Random(f"grpo-{seed}").shuffle(train)
    return DatasetDict(train=_rows(train), eval=_rows(evals))


def sft_examples(ds: Dataset) -> Dataset:
    """Prompt-only rows with an answer -> conversational prompt / completion rows (hfpar.data.tokenize_sft's format)."""
    return Dataset.from_dict(
        {"prompt": list(ds["prompt"]), "completion": [[{"role": "assistant", "content": a}] for a in ds["answer"]]}
    )
