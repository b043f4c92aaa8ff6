"""Context parallelism on the supported HF families: Llama, Mistral, Qwen2, Qwen3 (q/k norms), Gemma (scaled
embeddings), float64, 2 gloo ranks, ring and Ulysses.

hfpar's attention injected through transformers' registry (`set_attn_implementation("hfpar_cp")`) on a row cut
over the cp ranks gives the logits of the unsharded model with its stock SDPA attention at this rank's
positions, and (summed over the cp ranks) the same parameter gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar.parallel.context_parallel import cp_rows, register_cp_attention, shard_batch, shift_labels
from tests.helpers.dist import run_distributed

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
T = 24


def _model(model_type: str):
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                               max_position_embeddings=64, sliding_window=None, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()


def _check(rank: int, world: int) -> dict:
    out = {}
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for model_type in FAMILIES:
        ref = _model(model_type)
        (ref(input_ids=ids).logits * w).sum().backward()
        ref_logits = ref(input_ids=ids).logits.detach()
        for mode in ("ring", "ulysses"):
            model = _model(model_type)
            model.set_attn_implementation(register_cp_attention())
            local, rows = shard_batch(shift_labels({"input_ids": ids, "labels": ids}), rank, world)
            with cp_rows(rows, dist.group.WORLD, mode):
                logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                (logits * w[:, rows.local]).sum().backward()
            worst = (logits.detach() - ref_logits[:, rows.local]).abs().max().item()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)                                              # each cp rank: its tokens' part
                worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item())
            out[(model_type, mode)] = worst
    return out


def test_cp_attention_in_every_supported_family():
    for per_rank in run_distributed(_check, 2, timeout=600):
        # Gemma's RMSNorm computes in float32 even in a float64 model (x.float()): float32 rounding there
        bad = {k: v for k, v in per_rank.items() if v > (1e-6 if k[0] == "gemma" else 1e-9)}
        assert not bad and len(per_rank) == 2 * len(FAMILIES), bad
