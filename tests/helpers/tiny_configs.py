"""Tiny configs of the decoder families the tests build from scratch (no weights downloaded).

CONFIGS[model_type] -> (config kwargs, attention implementations): the families whose padding-free rows the tests
check against each sample alone (tests/unit/test_padding_free.py, tests/unit/test_varlen_attention.py,
tests/distributed/test_chunked_loss.py)
save_tiny(model_type, layers, path): a random-init tiny model of any family (the family sweep's tiny config) and the
embedded tokenizer saved for a recipe launch (tests/launch/test_tp_families_recipe.py, test_padding_free_recipe.py)
llama4_cp(chunk): Llama 4 text overrides that make what context parallelism must honour act in a short row
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar import data

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "use_cache": False,
    "pad_token_id": 0,
}
WINDOW = {"sliding_window": 5}  # shorter than most samples: the window is really cut
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
CONFIGS = {  # (config kwargs, attention implementations)
    "llama": (TINY, ("eager", "sdpa")),
    "mistral": ({**TINY, **WINDOW}, ("eager", "sdpa")),
    "mixtral": ({**TINY, **WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}, ("eager", "sdpa")),
    "qwen2": (
        {**TINY, **WINDOW, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]},
        ("eager", "sdpa"),
    ),
    "qwen2_moe": ({**TINY, **MOE, "shared_expert_intermediate_size": 32}, ("eager", "sdpa")),
    "qwen3": (TINY, ("eager", "sdpa")),
    "qwen3_moe": ({**TINY, **MOE}, ("eager", "sdpa")),
    "gemma": (TINY, ("eager", "sdpa")),
    "gemma2": ({**TINY, **WINDOW}, ("eager",)),  # transformers has no sdpa path for Gemma2 (soft-capping)
    "gemma3_text": ({**TINY, **WINDOW}, ("eager", "sdpa")),
    "phi3": ({**TINY, **WINDOW}, ("eager", "sdpa")),
    "olmo2": (TINY, ("eager", "sdpa")),
    "starcoder2": ({**TINY, **WINDOW}, ("eager", "sdpa")),
    "gpt2": (
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 64, "use_cache": False},
        ("eager", "sdpa"),
    ),  # learned absolute positions, from the position ids
}


def save_tiny(model_type: str, layers: int, path: Path) -> str:
    cfg = tiny_config(model_type, layers)
    cfg.max_position_embeddings = 512  # the recipe's packed rows are longer than the sweep's 64 (GPT-BigCode's wpe)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return str(path)


def llama4_cp(chunk: int) -> dict:
    """Llama 4 text: chunked attention on its RoPE layer (chunks of `chunk` positions, shorter than the rows), the
    attention temperature on its NoPE layer (floor_scale 4: it steps inside the row), a small MoE feed-forward."""
    return {
        "attention_chunk_size": chunk,
        "no_rope_layers": [1, 0],
        "floor_scale": 4,
        "attn_temperature_tuning": True,
        "intermediate_size_mlp": 64,
        "num_local_experts": 4,
    }
