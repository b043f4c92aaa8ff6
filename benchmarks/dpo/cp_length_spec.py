"""What benchmarks/dpo/cp_length.py runs: the model, the runs and their flags, the measured step, the pairs.

Used by cp_length.py (driver and ranks) and cp_length_report.py:
    rows = pairs(4096, n=2)              # 2 pairs of 4096 tokens (prompt + chosen + rejected)
    path = data_file(root, 4096)         # the same pairs as a .jsonl file, written once
"""

from __future__ import annotations

import random
import string
from pathlib import Path

from benchmarks.common.cp_length import CP_RUNS, TRAIN_FLAGS, jsonl_once
from benchmarks.dpo.trl_compare import SMALL

CONFIG = {**SMALL, "max_position_embeddings": 1 << 16}
RUNS = {"cp1": ("single", 1, []), **CP_RUNS}
FLAGS = [
    *TRAIN_FLAGS,
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "1",
    "--beta",
    "0.1",
    "--max_length",
    "65536",
    "--max_seq_length",
    "65536",
]
MEASURED_STEP = 1  # the second step (0-based): the model, reference and optimizer state exist at its start


def pairs(length: int, n: int = 2, seed: int = 0) -> list[dict]:
    """n standard-format pairs of `length` tokens (prompt + chosen + rejected) for the embedded character tokenizer:
    the prompt L/4 tokens with its bos, each completion (L - L/4)/2 with the eos the tokenization appends."""
    rng = random.Random(seed + length)
    prompt_n = length // 4
    chosen_n = (length - prompt_n) // 2
    rejected_n = length - prompt_n - chosen_n

    def text(k: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + "     ") for _ in range(k))

    return [
        {"prompt": text(prompt_n - 1), "chosen": text(chosen_n - 1), "rejected": text(rejected_n - 1)} for _ in range(n)
    ]


def data_file(root: Path, length: int) -> str:
    """The pairs of `length` as JSON Lines under root, written once."""
    return jsonl_once(root / f"pairs_{length}.jsonl", lambda: pairs(length))
