"""LoRA on a tensor-parallel model, every causal-LM type: TP=2 + LoRA against LoRA on the unsplit model.

    python -m benchmarks.tensor_parallel.lora_sweep [model_type ...]    # none: every causal-LM type (~2 min)

Per type, on 2 gloo ranks: the family sweep's tiny model (family_sweep.build, float64), PEFT's LoRA on every linear
layer ("all-linear", r 4, alpha 8, no dropout; on a MoE model also the routers' and experts' weights, as PEFT resolves
it) on a copy of it, and on the model itself through the recipes' order (hfpar.parallelize): the targets resolved
before TP (hfpar.loading.lora.lora_targets), the MoE step (apply_moe: blocks holding adapters stay the HF model's own,
the others become hfpar's MoE layers), apply_tensor_parallel, then the adapters (those on parallel layers split by
hfpar.parallel.tensor_parallel.lora). MoE models train without their aux loss here (output_router_logits off on both:
the adapters' path alone). Compared: the loss and every adapter's gradient (gathered),
then one SGD step on both, again (B starts at zero, so the first step checks B's gradients and the second A's as
well); within 1e-4. A type the TP family sweep refuses or skips is counted so here too.
Results: benchmarks/results/tensor_parallel/lora_sweep.json (when every type ran).
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
from types import SimpleNamespace

from benchmarks.common.launch import results_dir
from benchmarks.tensor_parallel.family_sweep import (
    ENCODER_STYLE,
    STATE_SPACE,
    TOL,
    _step_compare,
    batch,
    build,
    per_type,
    ref_loss,
    report,
    sweep,
    vocab,
)
from hfpar.parallel.expert_parallel import has_moe_blocks

LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear", seed=0)


MOE_ARGS = SimpleNamespace(upcycle_experts=0, gradient_accumulation_steps=1)


def check(model_type: str, ctx, sp: bool = False) -> dict:
    from hfpar.loading.lora import apply_lora, lora_targets
    from hfpar.loading.lora_targets import adapters_in_moe_blocks
    from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel
    from hfpar.parallelize import apply_moe

    if model_type in ENCODER_STYLE or model_type in STATE_SPACE:
        return {"status": "skipped", "why": "not in the TP family sweep's scope"}
    try:
        model = build(model_type)
        if getattr(model.config, "output_router_logits", False):
            model.config.output_router_logits = False
        ref = copy.deepcopy(model)
        if getattr(ref, "loss_type", None) in (None, "ForCausalLM", "ForConditionalGeneration"):
            ref.loss_function = ref_loss
        ids, labels = batch(vocab(model))
        ref = apply_lora(ref, LORA, "lm")
        ref(input_ids=ids, labels=labels).loss.backward()
    except Exception as e:  # noqa: BLE001 - a family whose tiny LoRA model does not train is skipped with the reason
        return {"status": "skipped", "why": f"unsharded LoRA model does not train: {type(e).__name__}: {str(e)[:160]}"}
    targets, moe = lora_targets(model, LORA, "lm"), has_moe_blocks(model)
    try:
        hf_blocks = apply_moe(model, MOE_ARGS, ctx, lora_at=adapters_in_moe_blocks(model, targets)) is not None
        apply_tensor_parallel(model, ctx.tp_group, sequence_parallel=sp)
        model = apply_lora(model, LORA, "lm", tp_targets=targets)
    except ValueError as e:  # TP's refusals, and LoRA's with TP
        return {"status": "refused", "why": str(e)[:300]}
    try:
        worst, name = max(_step_compare(model, ref, ids, labels), _step_compare(model, ref, ids, labels))
    except Exception as e:  # noqa: BLE001
        return {
            "status": "mismatched",
            "why": f"{type(e).__name__}: {str(e)[:300]}",
            "trace": traceback.format_exc()[-600:],
        }
    split = sum(
        isinstance(getattr(m, "base_layer", None), (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()
    )
    return {
        "status": "exact" if worst < TOL else "mismatched",
        "worst_rel": worst,
        "worst": name,
        "split_adapters": split,
        **({"hf_blocks": hf_blocks} if moe else {}),
    }


def _line(mt: str, r: dict) -> str:
    worst = f"{r.get('worst_rel', '')!s:10.10s} {r.get('worst', '')}"
    blocks = f"{r.get('hf_blocks', '')!s:6s}"
    return f"{mt:28s} {r['status']:10s} {blocks} {r.get('split_adapters', '')!s:4s} {worst} {r.get('why', '')[:300]}"


def sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False, sp: bool = False) -> dict:
    from hfpar.context import ParallelContext

    ctx = ParallelContext.from_degrees(world_size, rank, tp=world_size).build_groups()
    return per_type(types, lambda mt: check(mt, ctx, sp), _line if verbose else None)


def main(argv: list[str]) -> dict:
    t0 = time.perf_counter()
    summary = sweep(sweep_worker, argv, ("exact", "refused", "mismatched", "skipped"))
    summary["tol"] = TOL
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return report(summary, results_dir("tensor_parallel") / "lora_sweep.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
