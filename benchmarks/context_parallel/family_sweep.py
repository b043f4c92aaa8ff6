"""Context parallelism over every causal-LM model type transformers ships: a tiny float64 model of each, cp=2 ring
and Ulysses against the unsharded model with its stock (eager) attention: logits at every position and every
parameter gradient (summed over the cp ranks), within 1e-6 relative. A model with token mixers run on the whole rows
(context_parallel/gathered.py: Mamba, gated-DeltaNet, short convolutions): a gradient within NOISE_X times what one
process shows when it sums that gradient over the ranks' positions (shard_check.split_noise) where that is larger.

    python -m benchmarks.context_parallel.family_sweep               # all types -> results/context_parallel/
    python -m benchmarks.context_parallel.family_sweep llama falcon  # some types, printed only
"""

from __future__ import annotations

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
    report,
    sweep,
    vocab,
)
from hfpar.parallel.context_parallel import cp_rows, register_cp_attention, shard_batch, shift_labels
from hfpar.parallel.context_parallel.adapt import cp_adapt
from hfpar.parallel.context_parallel.gathered import gather_mixers
from hfpar.parallel.context_parallel.layout import zigzag_indices
from hfpar.parallel.context_parallel.mixing import token_mixers
from hfpar.parallel.context_parallel.probe import cp_attention_problems
from hfpar.parallel.context_parallel.shard_check import NOISE_X, shard_problem, split_noise

TOL = 1e-6
T = 16


def check(model_type: str) -> dict:
    if model_type in ENCODER_STYLE or model_type in STATE_SPACE:
        return {"status": "skipped", "why": "encoder-style / multimodal / state-space"}
    for layers, dtype in ((2, torch.float64), (4, torch.float64), (2, torch.float32), (4, torch.float32)):
        try:
            ref = build(model_type, layers=layers, dtype=dtype)
            try:  # SDPA where the family has it: eager softmaxes in float32 (a 1e-7 floor in a float64 model)
                ref.set_attn_implementation("sdpa")
            except (ValueError, ImportError):
                pass
            v = vocab(ref)
            ids = torch.randint(3, v, (2, T), generator=torch.Generator().manual_seed(1))
            w = torch.randn(
                2, T, ref.get_output_embeddings().out_features, generator=torch.Generator().manual_seed(2), dtype=dtype
            )
            pos = torch.arange(T)[None].expand(2, T)
            logits = ref(input_ids=ids, position_ids=pos).logits
            (logits * w[..., : logits.shape[-1]]).sum().backward()
            break
        except Exception as e:  # noqa: BLE001
            why = f"tiny model does not build / train: {type(e).__name__}: {str(e)[:160]}"
    else:
        return {"status": "skipped", "why": why}
    cfg = ref.config
    if problems := cp_attention_problems(cfg):
        return {"status": "refused", "why": problems[0]}
    mixers, why = token_mixers(cfg)
    if why:
        return {"status": "refused", "why": why}
    shard_why = shard_problem(cfg)  # the preflight's last check; the real cp run below decides whether it was right
    ref_logits = logits.detach()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"status": "exact", "dtype": str(dtype).removeprefix("torch.")}
    noise = {}
    if mixers:  # gathered mixers: what one process's own arithmetic does to a gradient summed over the ranks' parts
        out["gathered"] = [c.rsplit(".", 1)[-1] for c in mixers]
        run = lambda m: m(input_ids=ids, position_ids=pos).logits  # noqa: E731
        noise = split_noise(ref, run, w[..., : logits.shape[-1]], [zigzag_indices(T, r, world) for r in range(world)])
    for mode in ("ring", "ulysses"):
        model = build(model_type, layers=layers, dtype=dtype)
        try:
            model.set_attn_implementation(register_cp_attention())
            cp_adapt(model)  # as enable_cp_attention does (without its refusals: the run decides)
            gather_mixers(model, mixers)
            local, rows = shard_batch(shift_labels({"input_ids": ids, "labels": ids}), rank, world)
            with cp_rows(rows, dist.group.WORLD, mode):
                lg = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                (lg * w[:, rows.local, : lg.shape[-1]]).sum().backward()
            worst, name = rel(lg.detach(), ref_logits[:, rows.local]), "logits"
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if q.grad is None:
                    continue
                g = p.grad.clone() if p.grad is not None else torch.zeros_like(q.grad)
                dist.all_reduce(g)
                # against the tolerance: above the noise floor one process shows, a gradient counts as over by that
                worst, name = max((worst, name), (rel(g, q.grad) * TOL / max(TOL, NOISE_X * noise.get(n, 0.0)), n))
        except Exception as e:  # noqa: BLE001
            worst, name = float("inf"), f"{type(e).__name__}: {str(e)[:200]} {traceback.format_exc()[-300:]}"
        out[mode] = {"worst_rel": worst, "worst": name}  # with gathered mixers: scaled to TOL by the noise floor
        if not worst < TOL:
            out["status"] = "mismatched"
    if shard_why:  # refused by the cut-rows check: right when the real cp run does differ
        return {**out, "status": "refused", "why": shard_why, "refusal_confirmed": out["status"] == "mismatched"}
    return out


def _line(mt: str, r: dict) -> str:
    return f"{mt:28s} {r['status']:10s} {r.get('ring', '')} {r.get('ulysses', '')} {r.get('why', '')[:300]}"


def sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    """check() every type on this rank (run_ranks); rank 0 prints a line per type when verbose."""
    return per_type(types, check, _line if verbose else None)


def main(argv: list[str]) -> dict:
    summary = sweep(sweep_worker, argv, ("exact", "refused", "mismatched", "skipped"))
    res = summary["results"].values()
    summary["tol"] = TOL
    summary["cut_rows_refusals"] = sum("refusal_confirmed" in r for r in res)
    summary["cut_rows_refusals_confirmed"] = sum(bool(r.get("refusal_confirmed")) for r in res)
    return report(summary, results_dir("context_parallel") / "family_sweep.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
