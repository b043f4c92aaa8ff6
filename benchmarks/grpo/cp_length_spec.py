"""What benchmarks/grpo/cp_length.py runs: the model, the runs and their flags, the measured step, the prompts and the
flags that fix a group's length.

Used by cp_length.py (driver and ranks) and cp_length_report.py:
    prompt_n, completion_n = split(4096)      # a group of length L: prompt L/8 tokens, each completion 7L/8
    argv(root, 4096)                          # the length's own recipe flags (its prompts file written once)
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from benchmarks.common.cp_length import CP_RUNS, TRAIN_FLAGS, jsonl_once
from benchmarks.dpo.trl_compare import SMALL
from benchmarks.grpo.trl_compare import REWARD

# the DPO benchmark's Llama (hidden 64, 2 layers, 4 heads / 2 kv heads of 16) with its vocabulary padded to 8192 rows:
# the embedded tokenizer's 128 tokens, the ids above them decode to nothing. The head then weighs against the
# activations as a real model's does (Qwen2.5-0.5B: vocab / hidden = 151936 / 896 = 170; here 8192 / 64 = 128):
# a vocabulary of 128 would hide what the full logits cost
CONFIG = {**SMALL, "max_position_embeddings": 1 << 16, "vocab_size": 8192}
GROUP = 4  # completions per prompt (--num_generations), all of one rank's micro-batch
CHUNK = 64  # --loss_chunk_size: completion tokens per chunk of the head's log-probs (64 x 8192 fp32: 2 MiB)
RUNS = {
    "cp1": ("single", 1, []),
    "cp1_full_logits": ("single", 1, ["--loss_chunk_size", "0"]),  # the targets' (N, V) logits, not chunked
    **CP_RUNS,
}
FLAGS = [
    *TRAIN_FLAGS,
    "--max_steps",
    "3",
    "--num_iterations",
    "2",  # steps 1-2 train window 0, step 3 generates window 1: its old and reference log-probs, then trains
    "--num_generations",
    str(GROUP),
    "--per_device_train_batch_size",
    str(GROUP),
    "--beta",
    "0.04",
    "--reward_funcs",
    REWARD,
    "--loss_chunk_size",
    str(CHUNK),
    "--max_prompt_length",
    "none",
]
MEASURED_STEP = 2  # the third step (0-based): generation, old + reference log-probs, training; optimizer state exists
PHASES = {
    "generation": "hfpar.rollout.engine:InPlaceEngine.generate",
    "logps": "hfpar.rollout.loop:Rollout._logps",
}


def split(length: int) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a group of `length`: the prompt L/8 with its bos, each completion 7L/8."""
    prompt_n = max(2, length // 8)
    return prompt_n, length - prompt_n


def prompts(length: int, n: int = 2, seed: int = 0) -> list[dict]:
    """n standard-format prompts of split(length)[0] tokens for the embedded character tokenizer (random letters; the
    bos the tokenization adds), each with the `letter` column the reward reads."""
    rng = random.Random(seed + length)
    k = split(length)[0] - 1
    return [
        {"prompt": "".join(rng.choice(string.ascii_lowercase + "   ") for _ in range(k)), "letter": "e"}
        for _ in range(n)
    ]


def data_file(root: Path, length: int) -> str:
    """The prompts of `length` as JSON Lines under root, written once."""
    return jsonl_once(root / f"prompts_{length}.jsonl", lambda: prompts(length))


def argv(root: Path, length: int) -> list[str]:
    """The length's recipe flags: its prompts, and completions of exactly 7L/8 tokens (EOS masked until then:
    --generation_kwargs min_new_tokens, TRL's name for the setting)."""
    c = split(length)[1]
    return [
        "--dataset_name",
        data_file(root, length),
        "--max_completion_length",
        str(c),
        "--generation_kwargs",
        json.dumps({"min_new_tokens": c}),
    ]
