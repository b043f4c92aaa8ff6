"""Tiny decoder models and a padded batch for the tensor-parallel tests (tests/distributed/test_tp_hf_loss.py,
test_tp_derived_plans.py): every dropout off, fp32, the families' own HF loss.

    model = build("qwen3")          # or build("gpt2"), build("mixtral") (4 small experts, eager experts)
    ids, mask, labels = batch()     # (2, 8), right padding and a masked prompt
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from hfpar.parallel.tensor_parallel.plans import TESTED_DERIVED_MODEL_TYPES
from hfpar.parallel.tiny_copy import TINY

DERIVED = list(TESTED_DERIVED_MODEL_TYPES)  # granite, starcoder2, smollm3, olmo, cohere, phi, 3 MoE families
# MoE families: 4 small experts; Qwen MoE with a dense MLP in layer 1 (TP-sharded next to whole MoE blocks)
MOE_TINY = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [1],
    },
}
ATTN = {"gemma2": "eager", "granite_swa": "eager"}
# multi-head latent attention (MiniCPM3): latent ranks, rope / nope parts of each head, one k/v per head
MLA_TINY = {
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 8,
    "num_key_value_heads": 4,
}
FAMILY_TINY = {**MOE_TINY, "minicpm3": MLA_TINY}


def _no_dropout(cfg):
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
            setattr(cfg, k, 0.0)
    return cfg


def build(model_type: str, seed: int = 0, **overrides):
    if model_type == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, **overrides)
    else:
        cfg = AutoConfig.for_model(model_type, **{**TINY, **FAMILY_TINY.get(model_type, {}), **overrides})
    torch.manual_seed(seed)
    kw = {"experts_implementation": "eager"} if model_type in MOE_TINY else {}  # HF's grouped_mm has no fp64
    model = AutoModelForCausalLM.from_config(_no_dropout(cfg), attn_implementation=ATTN.get(model_type, "sdpa"), **kw)
    return model.float().train()


def batch(vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 8), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding
    ids[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100  # a masked prompt
    return ids, mask, labels


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


OLMO2_PER_HEAD = {  # wrong on purpose: olmo2's q_norm / k_norm span every head (HF: colwise_gather_output)
    "model.embed_tokens": "vocab_embedding",
    "model.layers.*.self_attn": "attention",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.q_norm": "replicated_heads",
    "model.layers.*.self_attn.k_norm": "replicated_heads",
    "lm_head": "colwise_lm_head",
}
