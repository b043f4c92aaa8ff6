"""What tests/distributed/test_tp_models.py builds and compares: a tiny HF model of a family, and the tensor-parallel
model's gradients gathered back for a comparison with one process.

    model = _build("qwen3", "float64")           # TINY's shape, the family's attention (eager where SDPA lacks it)
    grads = _full_grads(model)                   # TP shards gathered back to full tensors
    worst, name = _worst(grads, ref_grads)       # the largest relative difference and its parameter
"""

from __future__ import annotations

import torch

from hfpar.parallel.sharding import shard_spec

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


ATTN = {"gemma2": "eager"}  # transformers 5.23 has no SDPA path for Gemma-2 (attention soft-capping)


def _case_id(case) -> str:
    mt, sp, dtype, extra = case
    return f"{mt}-{'sp' if sp else 'tp'}-{dtype}" + ("".join(f"-{k}" for k in extra))


def _build(model_type: str, dtype: str = "float64", seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN.get(model_type, "sdpa"))
    model = model.to(getattr(torch, dtype))
    return model.train()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _tp_sharded(p) -> bool:
    spec = shard_spec(p)
    return spec is not None and spec.kind == "tp" and spec.sharded


def _full_grads(model) -> dict[str, torch.Tensor]:
    from hfpar.parallel.tensor_parallel import gather_shards

    out = {}
    for n, p in model.named_parameters():
        meta = shard_spec(p)
        out[n] = p.grad if not _tp_sharded(p) else gather_shards(p.grad, meta.dim, meta.group, meta.packed_splits)
    return out


def _worst(got: dict, ref: dict) -> tuple[float, str]:
    return max((_rel(got[n], ref[n]), n) for n in ref)
