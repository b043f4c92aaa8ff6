"""Context parallelism on HF families, float64, 2 gloo ranks, ring and Ulysses: the original five (Llama, Mistral,
Qwen2, Qwen3 with q/k norms, Gemma with scaled embeddings) and families accepted by the behaviour probe alone (no
name list): OLMo-2, Phi-3, Granite, Cohere, StableLM, SmolLM3 (no-RoPE layers), Mistral and Qwen2 with sliding
windows shorter than the row, Cohere 2 (sliding layers), GPT-OSS (attention sinks, sliding layers, MoE), Phi-3 with
longrope switching factors between the ranks' largest positions, Gemma 2 (sliding layers and logit soft-capping,
hard enough to bite: cap 1.0), and Llama 4 (chunked attention, its attention temperature from the index in the row).

hfpar's attention injected through transformers' registry (`set_attn_implementation("hfpar_cp")`) on a row cut
over the cp ranks gives the logits of the unsharded model with its stock attention (SDPA; eager for Gemma 2,
whose soft-capping SDPA cannot express) at this rank's positions, and (summed over the cp ranks) the same
parameter gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar.parallel.context_parallel import cp_rows, register_cp_attention, shard_batch, shift_labels
from hfpar.parallel.context_parallel.adapt import cp_adapt
from hfpar.parallel.context_parallel.probe import cp_attention_problems
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import llama4_cp

T = 24
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "sliding_window": None,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WINDOW = 5  # shorter than a row (24) and than a shard (12): the window cuts blocks on every rank
FAMILIES = {  # name: (model_type, config overrides, reference attention)
    "llama": ("llama", {}, "sdpa"),
    "mistral": ("mistral", {}, "sdpa"),
    "qwen2": ("qwen2", {}, "sdpa"),
    "qwen3": ("qwen3", {}, "sdpa"),
    "gemma": ("gemma", {}, "sdpa"),
    "olmo2": ("olmo2", {}, "sdpa"),
    "phi3": ("phi3", {}, "sdpa"),
    "granite": ("granite", {}, "sdpa"),
    "cohere": ("cohere", {}, "sdpa"),
    "stablelm": ("stablelm", {}, "sdpa"),
    "smollm3": ("smollm3", {}, "sdpa"),
    "mistral_window": ("mistral", {"sliding_window": WINDOW}, "sdpa"),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, "sdpa"),
    "cohere2_window": ("cohere2", {"sliding_window": WINDOW}, "sdpa"),
    # attention sinks (s_aux) on sliding and full layers, MoE experts (eager: GPT-OSS has no SDPA path)
    "gpt_oss_sinks_window": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "eager",
    ),
    # longrope: its factors switch at original_max_position_embeddings 20, between the ranks' largest positions of a
    # 24-token row (23 on rank 0, 17 on rank 1): equal only when every rank sees the whole row's (rotary.py)
    "phi3_longrope": (
        "phi3",
        {
            "original_max_position_embeddings": 20,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 20,
                "short_factor": [1.0, 1.1, 1.3, 1.5],
                "long_factor": [2.0, 3.0, 5.0, 9.0],
            },
        },
        "sdpa",
    ),
    # Llama 4: chunked attention on its RoPE layer (chunks of 5 positions: cut across both ranks' shards), the
    # attention temperature on its NoPE layer (floor_scale 4: the scaling steps inside the row); MoE feed-forward
    "llama4_chunked_temperature": (
        "llama4_text",
        llama4_cp(5),
        "sdpa",
    ),
    "gemma2_softcap_window": (
        "gemma2",
        {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 8},
        "eager",
    ),
}


def _config(name: str):
    model_type, extra, _ = FAMILIES[name]
    return AutoConfig.for_model(model_type, **{**TINY, **extra})


def _model(name: str):
    torch.manual_seed(0)
    moe = {"experts_implementation": "eager"} if name.startswith("gpt_oss") else {}  # grouped_mm: no float64
    return AutoModelForCausalLM.from_config(_config(name), attn_implementation=FAMILIES[name][2], **moe).double()


def _check(rank: int, world: int) -> dict:
    out = {}
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for name in FAMILIES:
        assert cp_attention_problems(_config(name)) == [], name  # the preflight's behaviour probe
        ref = _model(name)
        (ref(input_ids=ids).logits * w).sum().backward()
        ref_logits = ref(input_ids=ids).logits.detach()
        for mode in ("ring", "ulysses"):
            model = _model(name)
            model.set_attn_implementation(register_cp_attention())
            cp_adapt(model)  # as enable_cp_attention does
            local, rows = shard_batch(shift_labels({"input_ids": ids, "labels": ids}), rank, world)
            with cp_rows(rows, dist.group.WORLD, mode):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                (logits * w[:, rows.local]).sum().backward()
            worst = (logits.detach() - ref_logits[:, rows.local]).abs().max().item()
            for (_, p), q in zip(model.named_parameters(), ref.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)  # each cp rank: its tokens' part
                worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item())
            out[(name, mode)] = worst
    return out


@pytest.mark.slow  # 28 s of the fast subset: still in the README test command
def test_cp_attention_in_every_supported_family():
    for per_rank in run_distributed(_check, 2, timeout=600):
        # float32 inside a float64 model: Gemma's RMSNorm (x.float()), Gemma 2's eager softmax, Cohere's LayerNorm
        bad = {k: v for k, v in per_rank.items() if v > (1e-6 if k[0].startswith(("gemma", "cohere")) else 1e-9)}
        assert not bad and len(per_rank) == 2 * len(FAMILIES), (bad, per_rank)
