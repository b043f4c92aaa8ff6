"""Sharded loading into pipeline stages, LoRA models, upcycled experts and from *.bin checkpoints
(hfpar.loading.views, loading_upcycle, loading_files): each equals the full load (from_pretrained) followed by the
same LoRA / upcycling / TP / EP / stage split / FSDP2 sharding, max abs diff 0, and reads less than the whole
checkpoint.

    python -m pytest -q -s tests/distributed/test_loading_views.py

In process (stages, LoRA) and on 2 gloo ranks (tests/helpers/dist.py: pp x tp, LoRA x FSDP2). Tiny models built
from configs and saved to tmp (no network).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Phi3Config

from hfpar.backends import STRATEGY
from hfpar.loading.sharded import build_skeleton, checkpoint_index, fsdp2_loader, load_sharded, loading_mode
from hfpar.parallel.expert_parallel import apply_expert_parallel, upcycle_to_moe
from hfpar.parallel.pipeline import PipelineChunks, PipelineStage, balanced_split
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from tests.helpers.dist import run_distributed
from tests.helpers.outputs import checkpoint_bytes

LAYERS4 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    pad_token_id=0,
)
LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear", seed=3)


def _save(path, cfg, cls=AutoModelForCausalLM, **kw) -> str:
    torch.manual_seed(0)
    cls.from_config(cfg).save_pretrained(path, **kw)
    return str(path)


def _assert_same(ref: torch.nn.Module, got: torch.nn.Module, what: str) -> None:
    """Same names, values (max abs diff 0; DTensors: each rank's local shard and placements), ShardSpecs,
    requires_grad, and nothing left on meta."""
    r = {**dict(ref.named_parameters(remove_duplicate=False)), **dict(ref.named_buffers())}
    g = {**dict(got.named_parameters(remove_duplicate=False)), **dict(got.named_buffers())}
    assert r.keys() == g.keys(), (what, r.keys() ^ g.keys())
    for k in r:
        a, b = r[k], g[k]
        if isinstance(a, DTensor):
            assert isinstance(b, DTensor) and a.placements == b.placements, (what, k)
            a, b = a.to_local(), b.to_local()
        assert not b.is_meta and a.shape == b.shape and a.dtype == b.dtype, (what, k)
        assert torch.equal(a, b), (what, k, float((a - b).abs().max()))
        assert r[k].requires_grad == g[k].requires_grad, (what, k)
        rs, gs = shard_spec(r[k]), shard_spec(g[k])
        assert (rs is None) == (gs is None), (what, k)
        if rs is not None:
            assert (rs.dim, rs.size, rs.packed_splits) == (gs.dim, gs.size, gs.packed_splits), (what, k)


def _full(path: str, cls=AutoModelForCausalLM, **kw):
    return cls.from_pretrained(path, dtype=torch.float32, **kw)


def _skeleton(path: str, cls=AutoModelForCausalLM, **kw):
    return build_skeleton(cls, path, checkpoint_index(path), config_updates=kw)


def _lora(model, task: str = "lm"):
    from hfpar.loading.lora import apply_lora  # noqa: PLC0415  (peft: an optional extra)

    return apply_lora(model, LORA, task)


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stage_reads_only_its_tensors(tmp_path, tied):
    """pp 2 and 3 (balanced split), interleaved chunks (pp 2 x 2 virtual stages) and LoRA stages (pp 2): every
    stage equals from_pretrained then the same split; tied embeddings: the first stage's embedding and the last
    stage's LM head both read the embedding's key (a tied checkpoint has no lm_head.weight)."""
    path = _save(tmp_path / "m", LlamaConfig(**LAYERS4, tie_word_embeddings=tied))
    index = checkpoint_index(path)
    assert ("lm_head.weight" in index) is not tied
    whole = checkpoint_bytes(index)

    def stage(pp: int, s: int, interleaved: bool = False, lora: bool = False):
        def split(model):
            peft = _lora(model) if lora else None
            hf = peft.get_base_model() if lora else model
            if interleaved:
                return PipelineChunks(hf, s, pp, [0, 1, 2, 3, 4])
            return PipelineStage(hf, s, balanced_split(hf, pp), peft_model=peft)

        return split

    cases = [(pp, s, False, False) for pp in (2, 3) for s in range(pp)]
    cases += [(2, s, True, False) for s in range(2)] + [(2, s, False, True) for s in range(2)]
    for pp, s, interleaved, lora in cases:
        what = f"pp{pp} stage {s}{' interleaved' if interleaved else ''}{' lora' if lora else ''}"
        split = stage(pp, s, interleaved, lora)
        ref, got = split(_full(path)), split(_skeleton(path))
        info = load_sharded(got, index)
        _assert_same(ref, got, what)
        assert info["bytes_read"] < whole * 0.75, (what, info["bytes_read"], whole)
        if tied and got.tied is not None:  # first: its embedding, last: its LM head (each its own copy)
            assert torch.equal(got.tied, _full(path).model.embed_tokens.weight), what
        if lora:
            assert any("lora_A" in n and p.abs().sum() > 0 for n, p in got.named_parameters()), what


def test_lora_base_model_loaded_sharded_keeps_adapters(tmp_path):
    """LoRA on a meta skeleton: adapters drawn as on the loaded model (same seed, same values), the base read
    afterwards; a classifier from a causal-LM checkpoint (head missing, initialised) and from a classification
    checkpoint (PEFT's modules_to_save copy of the head reads the head's key too)."""
    lm = _save(tmp_path / "lm", LlamaConfig(**LAYERS4, tie_word_embeddings=True))
    ref, got = _lora(_full(lm)), _lora(_skeleton(lm))
    assert any(p.is_meta for p in got.parameters()) and not any(
        p.is_meta for n, p in got.named_parameters() if "lora_" in n
    )
    load_sharded(got, checkpoint_index(lm))
    _assert_same(ref, got, "lora lm")
    cls = _save(tmp_path / "cls", LlamaConfig(**LAYERS4, num_labels=3), AutoModelForSequenceClassification)
    for path in (cls, lm):
        torch.manual_seed(1)
        ref = _lora(_full(path, AutoModelForSequenceClassification, num_labels=3), "classify")
        torch.manual_seed(1)
        got = _lora(_skeleton(path, AutoModelForSequenceClassification, num_labels=3), "classify")
        load_sharded(got, checkpoint_index(path))
        _assert_same(ref, got, f"lora classify from {os.path.basename(path)}")


def _pp_tp(rank, world, path):
    """pp 2 x tp 2: each TP rank builds both stages of its TP slice; equal to from_pretrained + TP + split."""
    index = checkpoint_index(path)
    for s in range(2):
        ref = PipelineStage(apply_tensor_parallel(_full(path)), s, [0, 2, 4])
        got = PipelineStage(apply_tensor_parallel(_skeleton(path)), s, [0, 2, 4])
        info = load_sharded(got, index)
        _assert_same(ref, got, f"pp2 x tp2 stage {s}")
        assert info["bytes_read"] < checkpoint_bytes(index) * 0.4, info
        dist.barrier()


def test_pipeline_stage_of_tensor_parallel_model(tmp_path):
    """Phi-3 (packed qkv and gate_up: each packed part's TP rows) with tied embeddings, split into 2 stages."""
    path = _save(tmp_path / "phi3", Phi3Config(**LAYERS4, tie_word_embeddings=True))
    run_distributed(_pp_tp, 2, path)


def _shard(model, mesh) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _lora_fsdp2(rank, world, path):
    """As accelerate's cpu_ram_efficient_loading path: state dict and buffers kept (the real LoRA adapters), model
    to meta, fully_shard, then hfpar's fsdp2_loader fills each rank's dim-0 shards (base from the files, adapters
    sliced from the kept state dict)."""
    mesh = init_device_mesh("cpu", (world,))
    ref = _lora(_full(path))
    _shard(ref, mesh)
    got = _lora(_skeleton(path))
    full_sd, buffers = got.state_dict(), dict(got.named_buffers())
    got = got.to(torch.device("meta"))
    got.tie_weights()
    _shard(got, mesh)
    fsdp2_loader(checkpoint_index(path))(SimpleNamespace(device=torch.device("cpu")), got, full_sd)
    for name, buf in buffers.items():  # accelerate re-registers the non-persistent buffers (rotary inv_freq)
        owner, _, leaf = name.rpartition(".")
        got.get_submodule(owner)._buffers[leaf] = buf
    _assert_same(ref, got, "lora x fsdp2")


def _tied_fsdp2(rank, world, path):
    """A model whose LM head is tied to its embedding (the checkpoint holds the embedding only), through accelerate's
    order: skeleton, meta, tie, fully_shard, hfpar's fsdp2_loader, tie again: was a StopIteration (the head's name
    read from the files alone); now the full load's values, one tensor under both names."""
    mesh = init_device_mesh("cpu", (world,))
    ref = _full(path)
    _shard(ref, mesh)
    got = _skeleton(path)
    full_sd = got.state_dict()
    got = got.to(torch.device("meta"))
    got.tie_weights()
    _shard(got, mesh)
    fsdp2_loader(checkpoint_index(path))(SimpleNamespace(device=torch.device("cpu")), got, full_sd)
    got.tie_weights()  # accelerate's fsdp2_prepare_model does, after loading
    for name, buf in ref.named_buffers():  # accelerate re-registers the non-persistent buffers (rotary inv_freq)
        owner, _, leaf = name.rpartition(".")
        got.get_submodule(owner)._buffers[leaf] = buf
    _assert_same(ref, got, "tied x fsdp2")
    assert got.lm_head.weight is got.model.embed_tokens.weight


def test_lora_fsdp2_loader(tmp_path):
    path = _save(tmp_path / "m", LlamaConfig(**LAYERS4, tie_word_embeddings=False))
    run_distributed(_lora_fsdp2, 2, path)


def test_tied_lm_head_fsdp2_loader(tmp_path):
    path = _save(tmp_path / "m", LlamaConfig(**LAYERS4, tie_word_embeddings=True))
    run_distributed(_tied_fsdp2, 2, path)


def test_bin_checkpoint_read_through_mmap(tmp_path):
    """pytorch_model.bin (torch's zip format, what save_pretrained(safe_serialization=False) writes) and a sharded
    pytorch_model.bin.index.json: loaded sharded like safetensors (tied Llama split into pipeline stages, LoRA);
    a legacy (pre-1.6 pickle) .bin cannot be memory-mapped and is left to from_pretrained (index None)."""
    cfg = LlamaConfig(**LAYERS4, tie_word_embeddings=True)
    for name, kw in (("bin", {}), ("bin_index", {"max_shard_size": "60KB"})):
        path = str(tmp_path / name)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.config.save_pretrained(path)
        if kw:  # transformers 5 writes safetensors only: shards and their index by hand, as older versions did
            _save_bin_shards(model.state_dict(), path)
        else:
            torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
        index = checkpoint_index(path)
        assert index and all(f.endswith(".bin") for f in index.values()), index
        for s in range(2):
            ref = PipelineStage(_full(path), s, [0, 2, 4])
            got = PipelineStage(_skeleton(path), s, [0, 2, 4])
            load_sharded(got, index)
            _assert_same(ref, got, f"{name} stage {s}")
        ref, got = _lora(_full(path)), _lora(_skeleton(path))
        load_sharded(got, index)
        _assert_same(ref, got, f"{name} lora")
    legacy = tmp_path / "legacy"
    cfg.save_pretrained(legacy)
    torch.save(model.state_dict(), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert checkpoint_index(str(legacy)) is None


def _save_bin_shards(state: dict, path: str) -> None:
    names = sorted(state)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
        torch.save({k: state[k].clone() for k in part}, os.path.join(path, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _upcycled(rank, world, path):
    """--upcycle_experts 4 under EP 2 (each rank 2 experts) and under TP 2 (MoE blocks whole: 4 experts on each TP
    rank, EP groups of one rank): equal to from_pretrained + upcycle + EP (+ TP), routers included."""
    index = checkpoint_index(path)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    for how, ep_group in (("ep2", None), ("tp2", singles[rank])):

        def build(model, meta: bool):
            upcycle_to_moe(model, 4, 2, seed=5)
            apply_expert_parallel(model, ep_group, check_replicated=not meta)
            return apply_tensor_parallel(model) if how == "tp2" else model

        ref, got = build(_full(path), False), build(_skeleton(path), True)
        info = load_sharded(got, index)
        _assert_same(ref, got, f"upcycled {how}")
        assert got.model.layers[0].mlp.experts.gate_up_proj.shape[0] == (2 if how == "ep2" else 4), how
        assert info["bytes_read"] <= checkpoint_bytes(index), (how, info)
        dist.barrier()


def test_upcycled_experts_built_from_the_dense_mlp(tmp_path):
    path = _save(tmp_path / "m", LlamaConfig(**LAYERS4, tie_word_embeddings=True))
    run_distributed(_upcycled, 2, path)


def test_loading_mode_of_compositions():
    """Which compositions load sharded (a pipeline stage, with TP / LoRA / any data-parallel strategy; LoRA under
    FSDP2) and which stay full, with the reason."""
    cfg = LlamaConfig(**LAYERS4)

    def mode(strategy="ddp", tp=1, ep=1, pp=1, peft=False, upcycle=0, config=cfg):
        args = SimpleNamespace(use_peft=peft, upcycle_experts=upcycle, sharded_loading=True)
        return loading_mode(args, SimpleNamespace(tp=tp, ep=ep, pp=pp, strategy=STRATEGY[strategy]), config)[0]

    assert [mode(pp=2), mode("fsdp2", pp=2), mode("zero1", pp=2), mode(pp=2, tp=2), mode(pp=2, peft=True)] == [
        "sharded"
    ] * 5
    assert mode("fsdp2", peft=True) == "fsdp2" and mode("fsdp2") == "fsdp2" and mode(tp=2) == "sharded"
    assert mode(ep=2, upcycle=4) == mode(tp=2, upcycle=4) == "sharded"
    assert [mode(peft=True), mode("zero3", peft=True), mode(upcycle=4), mode("fsdp2", upcycle=4)] == ["full"] * 4
