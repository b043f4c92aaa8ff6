"""Shared by the MoE speed benchmarks (gpu.py, ep_cpu.py): the two layer shapes, block builders and timing.

    cfg = layer_config("qwen3", scale="real")           # Qwen3-30B-A3B: H 2048, 128 experts of 768, top-8
    cfg = layer_config("deepseek_v3", scale="cpu")      # DeepSeek-V3's router / experts count, narrower experts
    model = build_model(cfg, device, dtype)             # a 1-layer CausalLM whose layer 0 is the MoE block
    ms = time_block(block, x, iters=5)                  # forward + backward of the block alone, median ms

Shapes come from transformers' config defaults (Qwen3MoeConfig / DeepseekV3Config) plus what the released
checkpoints set: Qwen3-30B-A3B has norm_topk_prob=True (the class default is False); DeepSeek-V3's defaults are the
released model's (hidden 7168, 256 routed experts of 2048, top-8, 1 shared expert, 8 groups / top-4 groups, sigmoid
scores with e_score_correction_bias, routed scaling 2.5). Layer 0 is made a MoE layer (first_k_dense_replace=0).
Scales: "real" (the GPU), "cpu" (the acceptance run on this machine: DeepSeek's experts and hidden size narrowed to
fit minutes of 2 shared cores, router and expert count kept), "tiny" (a code-path test).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

SCALES = ("real", "cpu", "tiny")

# overrides of the transformers defaults, per scale (None: keep the default)
_QWEN3 = {
    "real": {},
    "cpu": {},
    "tiny": {
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}
_DSV3 = {
    "real": {},
    "cpu": {
        "hidden_size": 1024,
        "moe_intermediate_size": 256,
        "num_attention_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
    },
    "tiny": {
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "head_dim": 8,
    },
}


def layer_config(shape: str, scale: str = "real", layers: int = 1, vocab: int = 256, **overrides):
    """The config of a `layers`-layer model whose every layer is a MoE layer of `shape` ("qwen3" / "deepseek_v3");
    `overrides`: config fields on top of the scale's."""
    if shape == "qwen3":
        from transformers import Qwen3MoeConfig

        kw = {"norm_topk_prob": True, **_QWEN3[scale], **overrides}
        cfg = Qwen3MoeConfig(num_hidden_layers=layers, vocab_size=vocab, use_cache=False, **kw)
    elif shape == "deepseek_v3":
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(
            num_hidden_layers=layers,
            vocab_size=vocab,
            first_k_dense_replace=0,
            use_cache=False,
            **{**_DSV3[scale], **overrides},
        )
    else:
        raise ValueError(f"shape={shape!r}: expected 'qwen3' or 'deepseek_v3'")
    return cfg


def describe(cfg) -> dict:
    E = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    out = {
        "model_type": cfg.model_type,
        "hidden": cfg.hidden_size,
        "experts": E,
        "expert_intermediate": cfg.moe_intermediate_size,
        "top_k": cfg.num_experts_per_tok,
    }
    if cfg.model_type == "deepseek_v3":
        out.update(
            shared_experts=cfg.n_shared_experts,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            router="sigmoid + e_score_correction_bias",
        )
    else:
        out.update(router="softmax", norm_topk_prob=cfg.norm_topk_prob)
    return out


def build_model(cfg, device, dtype, seed: int = 0):
    """The CausalLM of cfg, initialised directly on `device` in `dtype` (no fp32 copy of an 11B-parameter layer).
    Each model gets its own copy of cfg: set_experts_implementation writes the config, which a shared one would
    carry over to every model built from it."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.train()


def moe_block(model):
    return model.model.layers[0].mlp


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def step_block(block, x: torch.Tensor) -> None:
    """One forward + backward of the block alone (grads of its input and parameters)."""
    xi = x.detach().requires_grad_(True)
    out = block(xi)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    block.zero_grad(set_to_none=True)


def time_block(block, x: torch.Tensor, iters: int = 5, warmup: int = 2) -> float:
    """Median ms of forward + backward of the block alone over `iters` runs after `warmup` ones."""
    times = []
    for i in range(iters + warmup):
        _sync(x.device)
        t0 = time.perf_counter()
        step_block(block, x)
        _sync(x.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def batched_mm_bytes(cfg, tokens: int, dtype) -> int:
    """transformers' batched_mm gathers one copy of the selected expert's weights per (token, expert) pair."""
    return (
        tokens
        * cfg.num_experts_per_tok
        * 3
        * cfg.hidden_size
        * cfg.moe_intermediate_size
        * torch.finfo(dtype).bits
        // 8
    )


def set_hf_experts(model, impl: str) -> None:
    model.set_experts_implementation(impl)
