"""LoRA on every MoE causal-LM type without expert parallelism: PEFT's "all-linear" adapters (routers, shared experts,
the experts' 3-D weights through PEFT's ParamWrapper), then hfpar's MoE step (apply_moe, as the recipes run it, one
process) against the same PEFT model left as transformers builds it: loss and every adapter gradient, float32 (as the
EP sweep; some families' own code casts to float32), within 1e-4 (relative, max |a - b| / max |b| per tensor). Blocks
holding adapters must stay the HF model's own (moe_replaced_paths: by what the blocks hold), blocks without adapters may
become hfpar's MoE layers: either way the adapters train as PEFT's on the HF model. tests/unit/test_lora_moe.py runs a
subset.

    python -m benchmarks.moe.lora_moe_sweep                   # every MoE type the EP sweep found -> results/moe/...
    python -m benchmarks.moe.lora_moe_sweep qwen2_moe jetmoe  # some types, printed only

Each type ends exact, refused (one line: PEFT's or hfpar's), mismatched (hfpar's path raised or differs) or skipped (the
tiny model not buildable, or PEFT on the HF model itself fails: the reason kept).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from types import SimpleNamespace

import torch
from tqdm import tqdm

from benchmarks.common.launch import results_dir
from benchmarks.moe.ep_family_sweep import build
from benchmarks.tensor_parallel.family_sweep import batch, vocab
from hfpar.loading.lora import apply_lora
from hfpar.parallel.expert_parallel import moe_replaced_paths
from hfpar.parallelize import apply_moe

TOL = 1e-4
LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear", seed=0)
MOE_ARGS = SimpleNamespace(upcycle_experts=0, gradient_accumulation_steps=1)
CTX = SimpleNamespace(ep=1, grad_replicas=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _loss_and_grads(model, ids, labels) -> tuple[torch.Tensor, dict]:
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if "lora_" in n}


def check(model_type: str, targets: str = "all-linear") -> dict:
    lora = SimpleNamespace(**{**vars(LORA), "lora_target_modules": targets})
    try:
        hf = build(model_type)
    except Exception as e:  # noqa: BLE001  (a tiny config transformers cannot build: recorded, not hidden)
        return {"status": "skipped", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    hf.config.output_router_logits = False  # no aux loss: the adapters' path alone (with it: refused in one line)
    replaced = moe_replaced_paths(hf)
    try:
        ref = apply_lora(copy.deepcopy(hf), lora, "lm")
        model = apply_lora(hf, lora, "lm")
        note = apply_moe(model, MOE_ARGS, CTX, moe_replaced=replaced)
    except ValueError as e:
        return {"status": "refused", "why": str(e).splitlines()[0][:300]}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at 0: random values, so every A gets a gradient (the same in both models)
        for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
                q.copy_(p)
    ids, labels = batch(vocab(hf))
    try:
        loss_ref, g_ref = _loss_and_grads(ref, ids, labels)
    except Exception as e:  # noqa: BLE001  (PEFT on the HF model itself: nothing of hfpar's ran yet)
        return {"status": "skipped", "why": f"PEFT on the HF model: {type(e).__name__}: {str(e)[:200]}"}
    try:
        loss, grads = _loss_and_grads(model, ids, labels)
    except Exception as e:  # noqa: BLE001  (hfpar's path failed where PEFT's own ran: a mismatch, with the reason)
        return {"status": "mismatched", "why": f"{type(e).__name__}: {str(e)[:200]}"}
    worst, where = _rel(loss, loss_ref), "loss"
    dead = [n for n, gr in g_ref.items() if gr is not None and gr.abs().sum() > 0 and grads.get(n) is None]
    for n, gr in g_ref.items():
        if gr is not None and grads.get(n) is not None and (r := _rel(grads[n], gr)) > worst:
            worst, where = r, n
    ok = worst <= TOL and not dead and set(grads) == set(g_ref)
    return {
        "status": "exact" if ok else "mismatched",
        "worst_rel": worst,
        "worst": dead[0] if dead else where,
        "adapters": len(g_ref),
        "hf_blocks": bool(note),  # the blocks stayed the HF model's own (adapters in them)
    }


def moe_types() -> list[str]:
    """The MoE types of the EP sweep's last record (exact or refused there: MoE blocks found)."""
    res = json.loads((results_dir("moe") / "ep_family_sweep.json").read_text())["results"]
    return [t for t, r in res.items() if r["status"] in ("exact", "refused", "mismatched")]


def main(argv: list[str]) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    types, t0, res = argv or moe_types(), time.perf_counter(), {}
    for mt in tqdm(types, desc="LoRA x MoE", disable=bool(argv)):
        res[mt] = check(mt)
        r = res[mt]
        if argv:
            print(f"{mt:24s} {r['status']:10s} {r.get('worst_rel', ''):<10} {r.get('worst', '')} {r.get('why', '')}")
    counts = {s: sum(r["status"] == s for r in res.values()) for s in ("exact", "refused", "mismatched", "skipped")}
    summary = {"counts": counts, "tol": TOL, "dtype": "float32", "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    if not argv:
        (results_dir("moe") / "lora_moe_sweep.json").write_text(json.dumps({**summary, "results": res}, indent=1))
    return {**summary, "results": res}


if __name__ == "__main__":
    main(sys.argv[1:])
