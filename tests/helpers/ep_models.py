"""What the expert-parallel model tests share: a tiny MoE model of a family, a padded batch, the relative difference.

Used by tests/distributed/test_ep_models.py and test_ep_single_process.py:
    model = _build("mixtral", "float64")          # TINY + MOE[model_type]
    ids, mask = _batch(seed=0)
and by the recipe launches of native MoE models (tests/launch/test_ep_families_parity.py, test_lora.py):
    path = save_tiny_moe("qwen3_moe", tmp / "m")  # a checkpoint directory with the embedded tokenizer
"""

from __future__ import annotations

import torch

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


TOL = {"float64": 1e-5, "float32": 1e-4}  # routing is always fp32 (router.py): ~1e-7 seen in fp64, not 1e-15


def _build(model_type: str, dtype: str = "float64", seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **MOE.get(model_type, {}), **overrides})
    torch.manual_seed(seed)
    kw = {"experts_implementation": "eager"} if model_type in MOE else {}  # HF's grouped_mm has no fp64
    return AutoModelForCausalLM.from_config(cfg, **kw).to(getattr(torch, dtype)).train()


def _batch(seed: int):
    """(2, 8) ids with right padding of a seed-dependent length; mask 1 = real token."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4 + seed % 3 :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def save_tiny_moe(model_type: str, path, **over) -> str:
    """The TP sweep's tiny config of `model_type` with `over`, vocabulary 128 (the embedded tokenizer's), random init
    (seed 0), saved with the embedded tokenizer; a bias-corrected router gets a bias that really corrects."""
    from transformers import AutoModelForCausalLM

    from benchmarks.tensor_parallel.family_sweep import tiny_config
    from hfpar import data

    cfg = tiny_config(model_type)
    for k, v in {**over, "vocab_size": 128, "max_position_embeddings": 512, "use_cache": False}.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return str(path)
