"""What benchmarks/dpo/cp_length.py runs: the model, the runs and their flags, the search's steps, the pairs.

Used by cp_length.py (driver and ranks) and cp_length_report.py:
    rows = pairs(4096, n=2)              # 2 pairs of 4096 tokens (prompt + chosen + rejected)
    path = data_file(root, 4096)         # the same pairs as a .jsonl file, written once
"""

from __future__ import annotations

import json
import os
import random
import string
from pathlib import Path

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1 << 16,
}
RUNS = {
    "cp1": ("single", 1, []),
    "cp2_ring": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ring"]),
    "cp4_ring": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ring"]),
    "cp2_ulysses": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ulysses"]),
    "cp4_ulysses": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ulysses"]),
}
FLAGS = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "1",
    "--gradient_accumulation_steps",
    "1",
    "--learning_rate",
    "1e-3",
    "--lr_scheduler_type",
    "constant",
    "--max_grad_norm",
    "1.0",
    "--beta",
    "0.1",
    "--eval_steps",
    "0",
    "--save_final_model",
    "false",
    "--logging_steps",
    "1",
    "--max_length",
    "65536",
    "--max_seq_length",
    "65536",
]
MEASURED_STEP = 1  # the second step (0-based): the model, reference and optimizer state exist at its start
BISECT, ROUND = 3, 16
TOL = 1e-4


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
    """The pairs of `length` as JSON Lines under root (every rank writes the same bytes: replaced atomically)."""
    path = root / f"pairs_{length}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in pairs(length)))
        os.replace(tmp, path)
    return str(path)
