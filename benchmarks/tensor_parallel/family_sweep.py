"""Tensor parallelism over every causal-LM model type transformers ships: a tiny model of each, TP=2 against the
unsharded model (loss and every gradient, one SGD step, again; float64, within 1e-4); tests/distributed/
test_tp_family_sweep.py runs a representative subset through sweep_worker.

    python -m benchmarks.tensor_parallel.family_sweep                 # all types ->
    results/tensor_parallel/family_sweep.json python -m benchmarks.tensor_parallel.family_sweep olmo2 falcon    # some
    types, printed only TP_SWEEP_FP32=1 python -m benchmarks.tensor_parallel.family_sweep ...   # in float32
    TP_SWEEP_SP=1 python -m benchmarks.tensor_parallel.family_sweep ...     # with sequence parallelism (its own JSON)
    res = run_ranks(sweep_worker, 2, ["olmo2", "falcon"])[0]          # {model_type: {"status": ..., ...}}

Counts: exact / refused (one line naming the module or entry) / mismatched / skipped (with the reason), the share
exact among those in scope (exact + refused + mismatched), how many of the exact ones have their decoder blocks
sharded, and the wall time.

A plain user loop: apply_tensor_parallel, model(input_ids, labels=).loss, backward, SGD step; nothing else is called
(replicated parameters that see part of the heads are summed by apply_tensor_parallel's own hooks). Loss and every
gradient against the unsharded model, before and after one SGD step, within 1e-4 relative (max |a - b| / max |b| per
tensor), in float64 by default: some families' fp32 rounding floor is above 1e-4 on their q/k-norm gradients
(Gemma-4 unified text: the unsharded fp32 model differs from its own fp64 run by 5e-5 at step 0), which is no TP bug.
The reference's loss is transformers' ForCausalLMLoss without its `logits.float()` (ref_loss): that cast turns
float64 logits into float32, so an "fp64" reference had fp32 loss rounding (~1e-8 relative) in every gradient, and
on HunYuan-MoE's top-1 router, whose gradient is zero in exact arithmetic (one renormalised weight is 1), two
different fp32 noise patterns (~2e-10 apart) read as a 2e-4 "mismatch" against the 1e-6 floor below.
Each type ends exact, refused (apply_tensor_parallel's one-line ValueError), mismatched, or skipped (tiny config not
buildable, encoder-style, pure state-space: the reason kept).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.common.launch import results_dir, run_ranks
from hfpar.parallel.tiny_copy import shrink

TOL = 1e-4
LR = float(os.environ.get("TP_SWEEP_LR", "0.1"))
DTYPE = torch.float32 if os.environ.get("TP_SWEEP_FP32") else torch.float64  # see below
SP = bool(os.environ.get("TP_SWEEP_SP"))  # with sequence_parallel=True
ENCODER_STYLE = (
    "bart",
    "bert",
    "bert-generation",
    "big_bird",
    "bigbird_pegasus",
    "blenderbot",
    "blenderbot-small",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "marian",
    "mbart",
    "megatron-bert",
    "mvp",
    "pegasus",
    "plbart",
    "prophetnet",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "trocr",
    "whisper",
    "xlm",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xlnet",
    "xmod",
    "reformer",
    "musicgen",
    "musicgen_melody",
    "moshi",
    "git",
    "mllama",
    "got_ocr2",
    "emu3",
    "phi4_multimodal",
)
STATE_SPACE = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma")


# what a family's own defaults lack to build at all in transformers 5.24 (a real checkpoint's config has it): DBRX's
# attention reads a rope_theta its sub-config does not default and clamps by clip_qkv even when None; LFM2-MoE and
# Cohere-Compass default no layer kinds / no RoPE per kind; Qwen4-Exp's default layers hold its sparse (QSA) attention,
# whose indexer sizes default to None
_QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
_ROPE = {"rope_type": "default", "rope_theta": 1e4}
FAMILY_KW = {
    "qwen4_exp_text": {"head_dim": 16, **_QSA},
    "qwen4_exp": {"text_config": {"head_dim": 16, **_QSA}},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "cohere_compass_text": {"rope_parameters": {k: _ROPE for k in ("full_attention", "sliding_attention")}},
}
# layer patterns given by a period (Jamba: attention every 8th layer from the 4th; Bailing-hybrid: every 6th):
# shortened so a copy of 2-4 layers holds every kind of layer
PERIODS = {
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "layer_group_size": 2,
}


def tiny_config(model_type: str, layers: int = 2):
    """A tiny config of `model_type` (hfpar.parallel.tiny_copy.shrink of the family's defaults, or of FAMILY_KW's
    config where the defaults do not build); raises when it cannot be built. layers: hybrid families (linear attention
    every 3 of 4 layers) need 4 to hold a full-attention layer."""
    from transformers import AutoConfig

    kw = FAMILY_KW.get(model_type)
    return shrink(AutoConfig.for_model(model_type, **(kw or {})), layers, keep=kw is not None, extra=PERIODS)


def build(model_type: str, seed: int = 0, layers: int = 2, dtype: torch.dtype = DTYPE):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, layers)
    with torch.device("meta"):  # a size field no shrink rule knows (BLT's hash embeddings): skip, do not OOM
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > 20_000_000:
        raise ValueError(f"the tiny config still has {n / 1e6:.0f}M parameters")
    torch.manual_seed(seed)
    kw = {"attn_implementation": "eager"}
    try:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    return model.to(dtype).train()


def vocab(model) -> int:
    """The ids a batch may draw: the config's vocabulary (CPM-Ant's embedding also holds its prompt tokens, which the
    LM head does not predict)."""
    n = model.get_input_embeddings().num_embeddings
    return min(n, getattr(model.config.get_text_config(), "vocab_size", None) or n)


def batch(vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 8), generator=g)  # (B, T)
    return ids, ids.clone()


def rel(a, b) -> float:
    """max |a - b| / max(max |b|, 1e-6): the floor keeps a gradient that is zero in exact arithmetic (a key bias under
    softmax's shift invariance: ~1e-9 of rounding on both sides) from reading as a 100 % difference."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def ref_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss in the logits' own dtype (it casts them to float32 first); the TP model's
    vocab_parallel_cross_entropy keeps float64 as float64, so both sides of the sweep compute the same math."""
    import torch.nn.functional as F

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    red = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.flatten(0, -2), shift_labels.flatten().to(logits.device), ignore_index=ignore_index, reduction=red
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch


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


def worst_then_sgd(model, ref, loss, ref_loss, got: dict, want: dict, lr: float) -> tuple[float, str]:
    """The largest relative difference (loss, then every gradient by name), then one SGD step on both models."""
    worst = max([(rel(loss.detach(), ref_loss.detach()), "loss")] + [(rel(got[n], want[n]), n) for n in want])
    for m in (model, ref):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
    return worst


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
    return worst_then_sgd(model, ref, loss, ref_loss, got, want, LR)


def check(model_type: str, sp: bool = SP) -> dict:
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    if model_type in ENCODER_STYLE:
        return {"status": "skipped", "why": "encoder-style / encoder-decoder / multimodal with a non-text input"}
    if model_type in STATE_SPACE:
        return {"status": "skipped", "why": "pure state-space / recurrent model"}
    # float32 where a family's code cannot run in float64 (XGLM's mask fill, Inkling-2's float32 buffers)
    for layers, dtype in [(n, d) for n in (2, 4) for d in dict.fromkeys((DTYPE, torch.float32))]:
        try:
            model = build(model_type, layers=layers, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a family whose tiny config does not build is skipped with the reason
            why = f"tiny model does not build: {type(e).__name__}: {str(e)[:160]}"
            continue
        ref = copy.deepcopy(model)
        if getattr(ref, "loss_type", None) in (None, "ForCausalLM", "ForConditionalGeneration"):  # as hf_loss.py
            ref.loss_function = ref_loss
        ids, labels = batch(vocab(model))
        try:
            ref(input_ids=ids, labels=labels).loss.backward()
            ref.zero_grad(set_to_none=True)
            break
        except Exception as e:  # noqa: BLE001
            why = f"unsharded tiny model does not train: {type(e).__name__}: {str(e)[:160]}"
    else:
        return {"status": "skipped", "why": why}
    t0 = time.perf_counter()
    try:
        apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    except ValueError as e:
        return {"status": "refused", "why": str(e)}
    apply_s = time.perf_counter() - t0
    try:
        (worst, name) = max(_step_compare(model, ref, ids, labels), _step_compare(model, ref, ids, labels))
    except Exception as e:  # noqa: BLE001
        return {
            "status": "mismatched",
            "why": f"{type(e).__name__}: {str(e)[:300]}",
            "trace": traceback.format_exc()[-600:],
        }
    from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    head = model.get_output_embeddings()
    blocks = any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m is not head for m in model.modules())
    return {
        "status": "exact" if worst < TOL else "mismatched",
        "worst_rel": worst,
        "worst": name,
        "apply_s": round(apply_s, 3),
        "verify_rel": getattr(model, "_hfpar_tp_verify_rel", None),
        "dtype": str(dtype).removeprefix("torch."),
        "blocks_sharded": blocks,
    }  # False: HF's plan shards only the embedding and the LM head


def per_type(types: list[str], check, line=None) -> dict:
    """{type: check(type) with its seconds} on this rank, warnings off, one thread; rank 0 prints line(type, result)
    when given; the ranks meet after each type (a sweep worker of run_ranks)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    res = {}
    for mt in types:
        t0 = time.perf_counter()
        res[mt] = check(mt)
        res[mt]["s"] = round(time.perf_counter() - t0, 2)
        if dist.get_rank() == 0 and line is not None:
            print(line(mt, res[mt]), flush=True)
        dist.barrier()
    return res


def _line(mt: str, r: dict) -> str:
    blocks = {True: "blocks", False: "flat"}.get(r.get("blocks_sharded"), "")
    return (
        f"{mt:28s} {r['status']:10s} {blocks:6s} {r.get('worst_rel', '')!s:10.10s} {r.get('worst', '')} "
        f"{r.get('why', '')[:600]}"
    )


def sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False, sp: bool = SP) -> dict:
    """check() every type on this rank (run_ranks); rank 0 prints a line per type when verbose."""
    return per_type(types, lambda mt: check(mt, sp), _line if verbose else None)


def sweep(worker, argv: list[str], statuses: tuple[str, ...], every=MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) -> dict:
    """`worker` over argv's model types (none: every type of `every`, by default every causal-LM type) on 2 ranks ->
    counts, exact share, wall time, results."""
    types = argv or sorted(every)
    t0 = time.perf_counter()
    res = run_ranks(worker, 2, types, True, timeout=7200)[0]
    counts = {s: sum(r["status"] == s for r in res.values()) for s in statuses}
    tested = counts["exact"] + counts["refused"] + counts["mismatched"]
    return {
        "counts": counts,
        "in_scope": tested,
        "exact_share": round(counts["exact"] / max(tested, 1), 4),
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": res,
    }


def report(summary: dict, out, argv: list[str]) -> dict:
    """Print the summary; write it to `out` when every type ran (no argv)."""
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if not argv:
        out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


def main(argv: list[str]) -> dict:
    summary = sweep(sweep_worker, argv, ("exact", "refused", "mismatched", "skipped"))
    blocks = sum(r["status"] == "exact" and bool(r.get("blocks_sharded")) for r in summary["results"].values())
    summary.update(blocks_sharded=blocks, blocks_sharded_share=round(blocks / max(summary["in_scope"], 1), 4), tol=TOL)
    out = results_dir("tensor_parallel") / ("family_sweep_sp.json" if SP else "family_sweep.json")
    return report(summary, out, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
