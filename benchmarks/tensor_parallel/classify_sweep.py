"""Tensor parallelism over every sequence-classification model type transformers ships (the classify and reward
recipes' `AutoModelForSequenceClassification`: BERT and its many copies, DeBERTa, DistilBERT, ELECTRA, ... and the
decoders' classifiers): a tiny model of each, TP=2 against the unsharded model, in a plain user loop
(apply_tensor_parallel, cross-entropy of the logits, backward, one SGD step, again): loss and every gradient within
1e-4 relative, float64 (float32 where a family cannot run in float64).

    python -m benchmarks.tensor_parallel.classify_sweep                   # all types -> results/tensor_parallel/
    python -m benchmarks.tensor_parallel.classify_sweep roberta deberta-v2  # some types, printed only
    python -m benchmarks.tensor_parallel.classify_sweep --lora [types]    # PEFT's LoRA (SEQ_CLS) on both sides

Rows: 4 of 10 tokens, three right-padded with their attention mask (the classify collator's layout: the classifier
reads each row's last real token, or its first for encoders). Each type ends exact, refused (apply_tensor_parallel's
one-line ValueError), mismatched, or skipped (tiny config not buildable: the reason kept). With --lora, the LoRA
sweep's adapters (lora_sweep.py: "all-linear", r 4, SEQ_CLS: the head trained whole) on the unsplit model and on the
TP model (hfpar.parallel.tensor_parallel.lora), compared as above -> results/tensor_parallel/classify_lora_sweep.json.
"""

from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from benchmarks.common.launch import results_dir
from benchmarks.tensor_parallel.family_sweep import (
    FAMILY_KW,
    PERIODS,
    TOL,
    _full_grads,
    per_type,
    report,
    sweep,
    worst_then_sgd,
)
from hfpar.parallel.tiny_copy import shrink

LENGTHS = (10, 7, 5, 9)  # real tokens per row (right padding after)
LABELS = 3


def build(model_type: str, layers: int, dtype: torch.dtype):
    """A tiny classifier of `model_type` (the TP sweep's shrunk config, dropout off), eager attention and experts,
    seed 0."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kw = FAMILY_KW.get(model_type)
    cfg = shrink(AutoConfig.for_model(model_type, **(kw or {})), layers, keep=kw is not None, extra=PERIODS)
    cfg.num_labels = LABELS
    if getattr(cfg, "pad_token_id", None) is None:  # as hfpar.recipe.load_model: the classifier finds rows by it
        cfg.pad_token_id = 0
    torch.manual_seed(0)
    try:  # eager experts: transformers' grouped_mm takes no float64
        model = AutoModelForSequenceClassification.from_config(
            cfg, attn_implementation="eager", experts_implementation="eager"
        )
    except (TypeError, ValueError):
        model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
    return model.to(dtype).train()


def rows(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, labels): right-padded rows of LENGTHS tokens."""
    text = getattr(model.config.get_text_config(), "vocab_size", None)
    v = min(model.get_input_embeddings().num_embeddings, text or 10**9)
    ids = torch.randint(3, v, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for r, n in enumerate(LENGTHS):
        mask[r, n:], ids[r, n:] = 0, model.config.pad_token_id
    return ids, mask, torch.arange(len(LENGTHS)) % LABELS


def _loss(model, ids, mask, labels) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
    loss.backward()
    return loss


def check(model_type: str, lora: bool = False) -> dict:
    from benchmarks.tensor_parallel.lora_sweep import LORA
    from hfpar.loading.lora import apply_lora, lora_targets
    from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel

    for layers, dtype in ((2, torch.float64), (4, torch.float64), (2, torch.float32)):
        try:
            model = build(model_type, layers, dtype)
            ref = copy.deepcopy(model)
            batch = rows(model)
            if lora:
                targets, ref = lora_targets(model, LORA, "classify"), apply_lora(ref, LORA, "classify")
            _loss(ref, *batch)
            break
        except Exception as e:  # noqa: BLE001 - a family whose tiny classifier does not build is skipped, reason kept
            why = f"tiny model does not build / train: {type(e).__name__}: {str(e)[:160]}"
    else:
        return {"status": "skipped", "why": why}
    try:
        apply_tensor_parallel(model, dist.group.WORLD)
        model = apply_lora(model, LORA, "classify", tp_targets=targets) if lora else model
    except ValueError as e:
        return {"status": "refused", "why": str(e)}
    try:
        worst = (0.0, "")
        for _ in range(2):  # before and after one SGD step
            loss, ref_loss = _loss(model, *batch), _loss(ref, *batch)
            got, want = _full_grads(model), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            if sorted(got) != sorted(want):
                raise AssertionError(f"grad names differ: {sorted(set(got) ^ set(want))[:4]}")
            worst = max(worst, worst_then_sgd(model, ref, loss, ref_loss, got, want, 0.1))
    except Exception as e:  # noqa: BLE001
        return {"status": "mismatched", "why": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()}
    blocks = any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())
    return {
        "status": "exact" if worst[0] < TOL else "mismatched",
        "worst_rel": worst[0],
        "worst": worst[1],
        "dtype": str(dtype).removeprefix("torch."),
        "blocks_sharded": blocks,
    }


def _line(mt: str, r: dict) -> str:
    return f"{mt:24s} {r['status']:10s} {r.get('worst_rel', '')!s:10.10s} {r.get('worst', '')} {r.get('why', '')[:300]}"


def sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False, lora: bool = False) -> dict:
    """check() every type on this rank (run_ranks); rank 0 prints a line per type when verbose."""
    return per_type(types, lambda mt: check(mt, lora), _line if verbose else None)


def lora_sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    return sweep_worker(rank, world_size, types, verbose, lora=True)


def main(argv: list[str]) -> dict:
    lora = "--lora" in argv
    argv = [a for a in argv if a != "--lora"]
    statuses = ("exact", "refused", "mismatched", "skipped")
    worker = lora_sweep_worker if lora else sweep_worker
    summary = sweep(worker, argv, statuses, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    summary["tol"] = TOL
    name = "classify_lora_sweep.json" if lora else "classify_sweep.json"
    return report(summary, results_dir("tensor_parallel") / name, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
