"""What the preflight tests share: a model directory holding only a config.json, and parsed sft options.

Used by tests/launch/test_preflight.py and test_preflight_parallel.py:
    path = _model_dir(tmp_path, num_attention_heads=6)     # a Llama config.json (no weights) under tmp_path/model
    args = _args("--tp_size", "2")                         # RecipeArgs of the sft recipe
"""

from __future__ import annotations

from transformers import LlamaConfig

from hfpar.config import parse_args


def _model_dir(tmp_path, **overrides):
    cfg = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=128,
    )
    cfg.update(overrides)
    path = tmp_path / "model"
    LlamaConfig(**cfg).save_pretrained(path)
    return str(path)


def _args(*argv):
    return parse_args(list(argv), recipe="sft")
