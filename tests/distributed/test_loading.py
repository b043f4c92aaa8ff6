"""Sharded loading (hfpar.loading.sharded): each rank reads only its slices, and holds exactly what a full load + shard
holds.

    python -m pytest -q -s tests/distributed/test_loading.py

In-process gloo ranks (tests/helpers/dist.py). Tiny models are built from configs and saved to tmp (no network).
"""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Phi3Config, Qwen3MoeConfig

from hfpar.loading.sharded import build_skeleton, checkpoint_index, load_sharded
from hfpar.parallel.expert_parallel import apply_expert_parallel
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from tests.helpers.dist import run_distributed
from tests.helpers.launch import read_run_info
from tests.helpers.outputs import checkpoint_bytes
from tests.helpers.results import record

# saves real checkpoints and measures host RSS per rank (~110 CPU-s): out of the fast subset (-m "not slow"), in CI
pytestmark = pytest.mark.slow

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
CONFIGS = {  # (config, parallelism, save_pretrained kwargs)
    "llama_tp2_tied_index": (
        LlamaConfig(**SMALL, intermediate_size=128, tie_word_embeddings=True),
        "tp",
        {"max_shard_size": "40KB"},
    ),  # a model.safetensors.index.json, 5+ files
    "phi3_tp2_packed": (Phi3Config(**SMALL, intermediate_size=128, pad_token_id=0), "tp", {}),
    "mixtral_ep2": (MixtralConfig(**SMALL, intermediate_size=96, num_local_experts=4), "ep", {}),
    "qwen3_moe_ep2": (
        Qwen3MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "ep",
        {},
    ),
    "qwen3_moe_tp2": (
        Qwen3MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "tp",
        {},
    ),
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
                assert (rs.kind, rs.dim, rs.size, rs.packed_splits, rs.group) == (
                    gs.kind,
                    gs.dim,
                    gs.size,
                    gs.packed_splits,
                    gs.group,
                ), (name, k)
            assert r[k].requires_grad == g[k].requires_grad, (name, k)
        assert worst == 0.0, (name, worst)
        if got.config.tie_word_embeddings:
            assert got.lm_head.weight is got.model.embed_tokens.weight, name
        assert got.training == ref.training, name
        out[name] = (worst, info["bytes_read"], checkpoint_bytes(index))
        dist.barrier()
    return out


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
        print(
            f"LOADING {name}: max |sharded - full+shard| {worst}, rank 0 read {read} of {full} bytes "
            f"({read / full:.2f})"
        )
        assert all(r[name][0] == 0.0 for r in per_rank)
        assert all(r[name][1] < full for r in per_rank), name  # each rank read less than the whole model


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _load_growth(rank, world, path, sharded: bool):
    """Peak RSS growth of this rank's process while it loads and TP-shards the model (bytes), and what it holds."""
    before = _rss()
    if sharded:
        index = checkpoint_index(path)
        model = load_sharded_tp(path, index)
    else:
        model = apply_tensor_parallel(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(p.numel() * 4 for p in model.parameters())
    return peak - before, held


def load_sharded_tp(path, index):
    model = apply_tensor_parallel(build_skeleton(AutoModelForCausalLM, path, index))
    load_sharded(model, index)
    return model


def test_tp2_rank_loads_about_half_the_memory(tmp_path):
    """~150 MB fp32 Llama: each TP=2 rank's peak RSS growth while loading, sharded vs from_pretrained + shard."""
    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    full = run_distributed(_load_growth, 2, str(tmp_path / "m"), False)  # fresh processes for each: own peaks
    sharded = run_distributed(_load_growth, 2, str(tmp_path / "m"), True)
    size = checkpoint_bytes(checkpoint_index(str(tmp_path / "m")))
    ratios = [s[0] / f[0] for s, f in zip(sharded, full)]
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    print(
        f"LOADING memory: checkpoint {mb(size)} MB fp32; peak RSS growth per TP=2 rank: full load + shard "
        f"{[mb(f[0]) for f in full]} MB, sharded {[mb(s[0]) for s in sharded]} MB, ratio "
        f"{[round(r, 2) for r in ratios]} (each rank holds {[mb(s[1]) for s in sharded]} MB)"
    )
    record(
        "loading/sharded",
        "tp2_llama_150MB",
        {
            "checkpoint_mb": mb(size),
            "full_load_peak_rss_growth_mb_per_rank": [mb(f[0]) for f in full],
            "sharded_peak_rss_growth_mb_per_rank": [mb(s[0]) for s in sharded],
            "ratio_per_rank": ratios,
            "held_mb_per_rank": [mb(s[1]) for s in sharded],
        },
        command="python -m pytest -q -s tests/distributed/test_loading.py -k half_the_memory",
    )
    assert all(s[1] == f[1] for s, f in zip(sharded, full))
    assert all(r < 0.75 for r in ratios), ratios  # about half (measured ratio in the print line)


def test_run_info_records_loading_and_host_rss(backend_runs):
    """No launch of its own: the data-parallel runs of the parity suite (tests/helpers/parity.py) load the saved base
    model; plain FSDP2 reads each rank's shards, ZeRO-3 loads partitioned under zero.Init, and run_info.json has
    every rank's host peak RSS (after loading and at the end)."""
    for name in ("fsdp2", "zero3", "ddp"):
        info = read_run_info(backend_runs[name])
        for key in ("host_peak_rss_bytes_per_rank", "host_peak_rss_after_load_bytes_per_rank"):
            assert len(info[key]) == 2 and all(isinstance(v, int) and v > 0 for v in info[key]), (name, key, info[key])
        assert all(
            e >= a
            for e, a in zip(info["host_peak_rss_bytes_per_rank"], info["host_peak_rss_after_load_bytes_per_rank"])
        ), name
    assert read_run_info(backend_runs["fsdp2"])["loading"]["mode"] == "fsdp2"
    zero3 = read_run_info(backend_runs["zero3"])["loading"]
    assert zero3["mode"] == "full" and zero3["partitioned_at_load"] is True, zero3
    assert read_run_info(backend_runs["ddp"])["loading"]["mode"] == "full"


def test_base_model_checkpoint_into_a_model_with_a_head(tmp_path):
    """A checkpoint of the base model (BertModel / LlamaModel, e.g. a sentence-transformers encoder) loaded into
    *ForSequenceClassification: transformers adds base_model_prefix to its keys; so must the sharded reader (it
    left every encoder weight to random init once: MiniLM under fsdp2.yaml trained at chance). Only the new head is
    missing, and every other tensor equals from_pretrained's."""
    from transformers import AutoModelForSequenceClassification, BertConfig, BertModel, LlamaModel

    bases = {
        "bert": BertModel(
            BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128)
        ),
        "llama": LlamaModel(LlamaConfig(**SMALL, intermediate_size=128)),
    }
    for name, base in bases.items():
        path = tmp_path / name
        base.save_pretrained(path)
        got = build_skeleton(
            AutoModelForSequenceClassification, str(path), checkpoint_index(str(path)), config_updates={"num_labels": 4}
        )
        head = "classifier" if name == "bert" else "score"
        assert got.hfpar_missing_keys == sorted(k for k in (f"{head}.weight", f"{head}.bias") if k in got.state_dict())
        load_sharded(got, checkpoint_index(str(path)))
        ref = AutoModelForSequenceClassification.from_pretrained(path, num_labels=4, dtype=torch.float32)
        for key, value in ref.state_dict().items():
            if not key.startswith(head):
                assert torch.equal(got.state_dict()[key], value), f"{name}: {key}"
