"""Tensor parallelism applied to the META SKELETON of every causal-LM type (what the recipes' sharded loading does
before any weight is read), at the family's default sizes, on 2 gloo ranks: is the plan verified (on the tiny copy,
hfpar.parallel.tensor_parallel.tiny_check), and does the answer agree with the family sweep's on loaded weights
(family_sweep.json: exact / refused)?

    python -m benchmarks.tensor_parallel.skeleton_sweep              # all types -> results/tensor_parallel/
    python -m benchmarks.tensor_parallel.skeleton_sweep gemma3n_text  # some types, printed only

Per type: accepted (verified), accepted unverified (the warning's reason), or refused (the one-line reason); then
`agree` against the family sweep: a type exact on loaded weights must be accepted here (else a false refusal) and a
type refused there must be refused here (else a plan applied to a skeleton that the loaded model would refuse: the
silent case this check exists for). Odd vocabularies are made even (the default GPT-2 vocabulary, 50257, is not
divisible by tp = 2; no family sweep case either).
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch
import torch.distributed as dist
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.common.launch import results_dir, run_ranks
from benchmarks.tensor_parallel.family_sweep import ENCODER_STYLE, FAMILY_KW, STATE_SPACE

STATUSES = ("accepted", "unverified", "refused", "crashed", "skipped")
# what a released checkpoint's config has where the family's defaults differ in what TP needs: DBRX's defaults hold
# one key-value head (not divisible by tp: refused), DBRX-Instruct's config 8
CHECKPOINT_KW = {"dbrx": {"attn_config": {**FAMILY_KW["dbrx"]["attn_config"], "kv_n_heads": 8}}}


def skeleton(model_type: str):
    """The family's default config at its own sizes, as the recipes' skeleton is built (parameters on the meta device,
    buffers computed on CPU: hfpar.loading.sharded.build_skeleton)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **CHECKPOINT_KW.get(model_type, FAMILY_KW.get(model_type, {})))
    text = cfg.get_text_config()
    if isinstance(getattr(text, "vocab_size", None), int) and text.vocab_size % 2:
        text.vocab_size += 1
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(cfg)


def check(model_type: str) -> dict:
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    if model_type in ENCODER_STYLE or model_type in STATE_SPACE:
        return {"status": "skipped", "why": "out of the family sweep's scope"}
    try:
        model = skeleton(model_type)
    except Exception as e:  # noqa: BLE001 - a family whose defaults do not build: skipped with the reason
        return {"status": "skipped", "why": f"{type(e).__name__}: {str(e)[:160]}"}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            apply_tensor_parallel(model, dist.group.WORLD)
        except ValueError as e:
            return {"status": "refused", "why": str(e)[:600], "apply_s": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 - not a one-line refusal: recorded as such
            return {"status": "crashed", "why": f"{type(e).__name__}: {str(e)[:300]}"}
    unverified = [str(w.message) for w in said if "not verified" in str(w.message)]
    return {
        "status": "unverified" if unverified else "accepted",
        "why": unverified[0][:300] if unverified else "",
        "apply_s": round(time.perf_counter() - t0, 2),
        "verify_rel": getattr(model, "_hfpar_tp_verify_rel", None),
    }


def worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    res = {}
    for mt in types:
        res[mt] = check(mt)
        if rank == 0 and verbose:
            print(f"{mt:28s} {res[mt]['status']:10s} {res[mt].get('why', '')[:300]}", flush=True)
        dist.barrier()
    return res


def agreement(results: dict, loaded: dict) -> dict:
    """Per type of the family sweep's scope: the skeleton's answer beside the loaded weights' one."""
    out = {"agree": [], "false_refusal": [], "applied_where_refused": [], "unverified": []}
    for mt, r in results.items():
        was = loaded.get(mt, {}).get("status")
        if was not in ("exact", "refused") or r["status"] == "skipped":
            continue
        if r["status"] == "unverified":
            out["unverified"].append(mt)
        elif (was == "exact") == (r["status"] == "accepted"):
            out["agree"].append(mt)
        else:
            out["false_refusal" if was == "exact" else "applied_where_refused"].append(mt)
    return out


def main(argv: list[str]) -> dict:
    types = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.perf_counter()
    res = run_ranks(worker, 2, types, True, timeout=7200)[0]
    counts = {s: sum(r["status"] == s for r in res.values()) for s in STATUSES}
    summary = {"counts": counts, "wall_s": round(time.perf_counter() - t0, 1), "results": res}
    loaded = json.loads((results_dir("tensor_parallel") / "family_sweep.json").read_text())["results"]
    summary["against_family_sweep"] = agreement(summary["results"], loaded)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if not argv:
        out = results_dir("tensor_parallel") / "skeleton_sweep.json"
        out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
