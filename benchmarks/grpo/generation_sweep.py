"""The GRPO rollout's generation under tensor and expert parallelism on every causal-LM model type transformers
ships: a tiny model of each (the TP sweep's: float64, eager; float32 where a family cannot run float64 or its eager
attention turns left padding into NaN), left-padded prompts of 5, 3, 7 and 4 tokens, 6 new tokens sampled with
hfpar's per-row Gumbel noise (hfpar.rollout.sampling: transformers' generate, its KV cache, `synced_gpus`), on 2 gloo
ranks against the unsharded model generating the same rows in one process: the tokens must be identical and every
step's logits within 1e-6 relative.

    python -m benchmarks.grpo.generation_sweep            # tp and ep, every type -> results/grpo/generation_sweep.json
    python -m benchmarks.grpo.generation_sweep tp llama   # one mode, some types, printed only

tp: apply_tensor_parallel over the 2 ranks, both generating all 4 rows (the LM head's vocabulary shards gathered by
generate). ep: apply_expert_parallel (MoE families; a dense one is refused in one line), each rank generating its own 2
rows, as data-parallel ranks do (the experts' all-to-all in every decoding step). Each type ends exact, refused (the
apply function's one-line ValueError), mismatched or skipped (encoder-style / state-space / tiny model not built).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback

import torch
import torch.distributed as dist

from benchmarks.common.launch import results_dir
from benchmarks.tensor_parallel.family_sweep import (
    ENCODER_STYLE,
    STATE_SPACE,
    build,
    per_type,
    rel,
    sweep,
    vocab,
)
from hfpar.parallel.expert_parallel import apply_expert_parallel
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from hfpar.rollout.engine import left_pad
from hfpar.rollout.sampling import row_key, sample

TOL = 1e-6
PROMPTS = (5, 3, 7, 4)
NEW = 6


def _generate(model, ids, mask, keys, synced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, (B, NEW, V) raw logits of every step) of hfpar's sampler (the rollout's own call)."""
    out = sample(
        model,
        ids,
        mask,
        keys,
        max_new_tokens=NEW,
        pad_token_id=0,
        synced_gpus=synced,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits, 1)


def check(model_type: str, mode: str) -> dict:
    if model_type in ENCODER_STYLE or model_type in STATE_SPACE:
        return {"status": "skipped", "why": "encoder-style / multimodal / state-space"}
    for layers, dtype in ((2, torch.float64), (4, torch.float64), (2, torch.float32), (4, torch.float32)):
        try:
            model = build(model_type, layers=layers, dtype=dtype).eval()
            try:  # SDPA where the family has it (eager float64 softmaxes in float32: NaN rows under left padding)
                model.set_attn_implementation("sdpa")
            except (ValueError, ImportError):
                pass
            ref = copy.deepcopy(model)
            g = torch.Generator().manual_seed(1)
            ids, mask = left_pad([torch.randint(3, vocab(model), (n,), generator=g).tolist() for n in PROMPTS], 0)
            keys = [row_key(0, 0, i, 0) for i in range(len(PROMPTS))]
            with torch.no_grad():
                ref_ids, ref_logits = _generate(ref, ids, mask, keys, False)
            if ref_logits.isnan().any():
                raise ValueError("NaN logits in the unsharded model")
            break
        except Exception as e:  # noqa: BLE001 - a family whose tiny model does not generate is skipped, reason kept
            why = f"tiny model does not generate: {type(e).__name__}: {str(e)[:160]}"
    else:
        return {"status": "skipped", "why": why}
    rows = slice(None)
    try:
        if mode == "tp":
            apply_tensor_parallel(model, dist.group.WORLD)
        else:
            apply_expert_parallel(model, ep_group=dist.group.WORLD)
            half = len(PROMPTS) // dist.get_world_size()
            rows = slice(dist.get_rank() * half, (dist.get_rank() + 1) * half)
    except ValueError as e:
        return {"status": "refused", "why": str(e)}
    try:
        with torch.no_grad():
            got_ids, got_logits = _generate(model, ids[rows], mask[rows], keys[rows], True)
    except Exception as e:  # noqa: BLE001
        return {"status": "mismatched", "why": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()}
    same = torch.equal(got_ids, ref_ids[rows])
    worst = rel(got_logits[..., : ref_logits.shape[-1]], ref_logits[rows])
    return {
        "status": "exact" if same and worst < TOL else "mismatched",
        "tokens_identical": same,
        "worst_rel": worst,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _line(mt: str, r: dict) -> str:
    return f"{mt:28s} {r['status']:10s} {r.get('worst_rel', '')!s:10.10s} {r.get('why', '')[:200]}"


def tp_worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    """check(type, "tp") of every type on this rank (run_ranks); rank 0 prints a line per type when verbose."""
    return per_type(types, lambda mt: check(mt, "tp"), _line if verbose else None)


def ep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    """check(type, "ep") of every type on this rank (run_ranks)."""
    return per_type(types, lambda mt: check(mt, "ep"), _line if verbose else None)


def main(argv: list[str]) -> dict:
    modes = [argv[0]] if argv and argv[0] in ("tp", "ep") else ["tp", "ep"]
    types = argv[1:] if argv and argv[0] in ("tp", "ep") else argv
    statuses = ("exact", "refused", "mismatched", "skipped")
    out = {}
    for mode in modes:
        out[mode] = sweep(tp_worker if mode == "tp" else ep_worker, types, statuses)
        out[mode]["tol"] = TOL
    print(json.dumps({m: {k: v for k, v in r.items() if k != "results"} for m, r in out.items()}))
    if not argv:  # every type of both modes ran
        (results_dir("grpo") / "generation_sweep.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
