"""Tensor parallelism over every causal-LM model type transformers ships: a tiny model of each, TP=2 against the
unsharded model (loss, every gradient, one SGD step, loss and every gradient again; fp32, within 1e-4 relative).

    python benchmarks/tp_family_sweep.py                      # all types -> benchmarks/results/tp_family_sweep.json
    python benchmarks/tp_family_sweep.py olmo2 falcon         # some types, printed only

A plain user loop: apply_tensor_parallel, model(**batch, labels=).loss, backward, SGD step; nothing else is called
(replicated parameters that see part of the heads must be summed by apply_tensor_parallel's own hooks).
Each type ends as exact, refused (apply_tensor_parallel's one-line ValueError), mismatched, or skipped (tiny config
not buildable, encoder-style, pure state-space: the reason printed).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-4
LR = float(os.environ.get("TP_SWEEP_LR", "0.1"))
DTYPE = torch.float32 if os.environ.get("TP_SWEEP_FP32") else torch.float64   # see below
OUT = Path(__file__).resolve().parent / "results" / "tp_family_sweep.json"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# other size fields of the families' configs, shrunk (by name) so every tiny model builds in well under a second
SHRINK = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 32,
          "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
          "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "num_kv_shared_layers": 0, "sliding_window": 4, "hidden_size_per_layer_input": 16,
          "vocab_size_per_layer_input": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
          "d_model": 64, "ffn_dim": 128, "n_heads": 4, "n_layers": 2, "num_layers": 2, "ffn_hidden_size": 128,
          "n_inner": 128, "multi_query": False, "d_ff": 128, "word_embed_proj_dim": 64, "max_seq_len": 64,
          "attention_chunk_size": 4, "rotary_dim": 8, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0}
ENCODER_STYLE = ("bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
                 "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp",
                 "pegasus", "plbart", "prophetnet", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
                 "roformer", "trocr", "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod", "reformer",
                 "musicgen", "musicgen_melody", "moshi", "git", "mllama", "got_ocr2", "emu3", "fuyu",
                 "phi4_multimodal", "moss_transcribe_diarize")
STATE_SPACE = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma")


def _no_dropout(cfg) -> None:
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
            setattr(cfg, k, 0.0)


def tiny_config(model_type: str):
    """A tiny config of `model_type` (text part shrunk for composite configs); raises when it cannot be built."""
    from transformers import AutoConfig
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    over = {k: v for k, v in {**TINY, **SHRINK}.items() if k in text.to_dict()}
    if text is base:
        cfg = AutoConfig.for_model(model_type, **over)
    else:
        sub = {"text_config": {**text.to_dict(), **over}}
        cfg = AutoConfig.for_model(model_type, **sub)
    _no_dropout(cfg)
    if cfg.get_text_config() is not cfg:
        _no_dropout(cfg.get_text_config())
    return cfg


def build(model_type: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    kw = {"attn_implementation": "eager"}
    try:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    return model.to(DTYPE).train()


def batch(vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 8), generator=g)                                  # (B, T)
    return ids, ids.clone()


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _full_grads(model) -> dict:
    from hfpar.parallel.sharding import shard_spec
    from hfpar.parallel.tensor_parallel import gather_shards
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        s = shard_spec(p)
        sharded = s is not None and s.kind == "tp" and s.sharded
        out[n] = gather_shards(p.grad, s.dim, s.group, s.packed_splits) if sharded else p.grad
    return out


def _step_compare(model, ref, ids, labels) -> tuple[float, str]:
    """(worst relative difference, its name) over the loss and every gradient (names must match)."""
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss, ref_loss = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    loss.backward()
    ref_loss.backward()
    got, want = _full_grads(model), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    if sorted(got) != sorted(want):
        raise AssertionError(f"grad names differ: {sorted(set(got) ^ set(want))[:4]}")
    worst = max([(rel(loss.detach(), ref_loss.detach()), "loss")] + [(rel(got[n], want[n]), n) for n in want])
    for m in (model, ref):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
    return worst


def check(model_type: str) -> dict:
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel
    if model_type in ENCODER_STYLE:
        return {"status": "skipped", "why": "encoder-style / encoder-decoder / multimodal with a non-text input"}
    if model_type in STATE_SPACE:
        return {"status": "skipped", "why": "pure state-space / recurrent model"}
    try:
        model = build(model_type)
    except Exception as e:  # noqa: BLE001 - a family whose tiny config does not build is skipped with the reason
        return {"status": "skipped", "why": f"tiny model does not build: {type(e).__name__}: {str(e)[:160]}"}
    ref = copy.deepcopy(model)
    ids, labels = batch(model.get_input_embeddings().num_embeddings)
    try:
        ref(input_ids=ids, labels=labels).loss.backward()
        ref.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "why": f"unsharded tiny model does not train: {type(e).__name__}: {str(e)[:160]}"}
    t0 = time.perf_counter()
    try:
        apply_tensor_parallel(model, dist.group.WORLD)
    except ValueError as e:
        return {"status": "refused", "why": str(e)}
    apply_s = time.perf_counter() - t0
    try:
        (worst, name) = max(_step_compare(model, ref, ids, labels), _step_compare(model, ref, ids, labels))
    except Exception as e:  # noqa: BLE001
        return {"status": "mismatched", "why": f"{type(e).__name__}: {str(e)[:300]}",
                "trace": traceback.format_exc()[-600:]}
    return {"status": "exact" if worst < TOL else "mismatched", "worst_rel": worst, "worst": name,
            "apply_s": round(apply_s, 3)}


def _rank(rank: int, world: int, port: int, types: list, out: str) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    res = {}
    for mt in types:
        t0 = time.perf_counter()
        res[mt] = check(mt)
        res[mt]["s"] = round(time.perf_counter() - t0, 2)
        if rank == 0:
            r = res[mt]
            print(f"{mt:28s} {r['status']:10s} {r.get('worst_rel', '')!s:24.24s} {r.get('worst', '')} {r.get('why', '')[:200]}", flush=True)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main(argv: list[str]) -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tp_sweep_{os.getpid()}.json"
    t0 = time.perf_counter()
    mp.spawn(_rank, (2, 29500 + os.getpid() % 1000, types, str(tmp)), nprocs=2)
    res = json.loads(tmp.read_text())
    wall = time.perf_counter() - t0
    counts = {s: sum(r["status"] == s for r in res.values()) for s in ("exact", "refused", "mismatched", "skipped")}
    tested = counts["exact"] + counts["refused"] + counts["mismatched"]
    summary = {"counts": counts, "in_scope": tested, "exact_share": round(counts["exact"] / max(tested, 1), 4),
               "wall_s": round(wall, 1), "tol": TOL, "results": res}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if not argv:
        OUT.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
