"""Sharded loading (hfpar.loading): each rank reads only its slices, and holds exactly what a full load + shard holds.

    python -m pytest -q -s tests/test_loading.py

In-process gloo ranks (tests/dist_utils.py). Tiny models are built from configs and saved to tmp (no network).
"""

from __future__ import annotations

import json
import resource
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
import torch.distributed as dist
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, Phi3Config, Qwen3MoeConfig)

from hfpar.loading import build_skeleton, checkpoint_index, fsdp2_loader, load_sharded
from hfpar.parallel.expert_parallel import apply_expert_parallel
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from tests.dist_utils import run_distributed
from tests.results import record

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
CONFIGS = {  # (config, parallelism, save_pretrained kwargs)
    "llama_tp2_tied_index": (LlamaConfig(**SMALL, intermediate_size=128, tie_word_embeddings=True), "tp",
                             {"max_shard_size": "40KB"}),               # a model.safetensors.index.json, 5+ files
    "phi3_tp2_packed": (Phi3Config(**SMALL, intermediate_size=128, pad_token_id=0), "tp", {}),
    "mixtral_ep2": (MixtralConfig(**SMALL, intermediate_size=96, num_local_experts=4), "ep", {}),
    "qwen3_moe_ep2": (Qwen3MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2), "ep",
                      {}),
    "qwen3_moe_tp2": (Qwen3MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2), "tp",
                      {}),
}


def _parallelize(model, how: str):
    if how == "tp":
        apply_tensor_parallel(model)
    else:
        apply_expert_parallel(model, check_replicated=not any(p.is_meta for p in model.parameters()))
    return model


def _tensors(model) -> dict:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def _same_as_full_load(rank, world, cases: dict):
    """Per case: sharded load vs from_pretrained then the same sharding: names, shapes, ShardSpecs, values
    (max abs diff 0), buffers (rotary inv_freq recomputed), ties kept, and fewer bytes read than the full model."""
    out = {}
    for name, (path, how) in cases.items():
        torch.manual_seed(0)
        ref = _parallelize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), how)
        index = checkpoint_index(path)
        got = _parallelize(build_skeleton(AutoModelForCausalLM, path, index), how)
        info = load_sharded(got, index)
        r, g = _tensors(ref), _tensors(got)
        assert r.keys() == g.keys(), (name, r.keys() ^ g.keys())
        worst = 0.0
        for k in r:
            assert r[k].shape == g[k].shape and r[k].dtype == g[k].dtype == torch.float32, (name, k)
            assert not g[k].is_meta, (name, k)
            worst = max(worst, float((r[k] - g[k]).abs().max()) if r[k].numel() else 0.0)
            rs, gs = shard_spec(r[k]), shard_spec(g[k])
            assert (rs is None) == (gs is None), (name, k)
            if rs is not None:
                assert (rs.kind, rs.dim, rs.size, rs.packed_splits, rs.group) == (gs.kind, gs.dim, gs.size,
                                                                                  gs.packed_splits, gs.group), (name, k)
            assert r[k].requires_grad == g[k].requires_grad, (name, k)
        assert worst == 0.0, (name, worst)
        if got.config.tie_word_embeddings:
            assert got.lm_head.weight is got.model.embed_tokens.weight, name
        assert got.training == ref.training, name
        out[name] = (worst, info["bytes_read"], _checkpoint_bytes(index))
        dist.barrier()
    return out


def _checkpoint_bytes(index: dict) -> int:
    total = 0
    for key, path in index.items():
        with safe_open(path, "pt") as f:
            total += torch.Size(f.get_slice(key).get_shape()).numel() * 4
    return total


def _save(tmp_path, name: str):
    cfg, how, kw = CONFIGS[name]
    torch.manual_seed(0)
    path = tmp_path / name
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, **kw)
    return str(path), how


def test_sharded_load_equals_full_load_then_shard(tmp_path):
    cases = {name: _save(tmp_path, name) for name in CONFIGS}
    assert (tmp_path / "llama_tp2_tied_index" / "model.safetensors.index.json").exists()
    per_rank = run_distributed(_same_as_full_load, 2, cases)
    for name in CONFIGS:
        worst, read, full = per_rank[0][name]
        print(f"LOADING {name}: max |sharded - full+shard| {worst}, rank 0 read {read} of {full} bytes "
              f"({read / full:.2f})")
        assert all(r[name][0] == 0.0 for r in per_rank)
        assert all(r[name][1] < full for r in per_rank), name   # each rank read less than the whole model
