"""Expert parallelism over every MoE causal-LM model type transformers ships: a tiny model of each, EP=2 against the
unsharded model (loss and every gradient, one SGD step, again; float32, within 1e-4); tests/distributed/
test_ep_family_sweep.py runs a representative subset through sweep_worker.

    python -m benchmarks.moe.ep_family_sweep                      # all types -> results/moe/ep_family_sweep.json
    python -m benchmarks.moe.ep_family_sweep olmo2 falcon         # some types, printed only
    EP_SWEEP_FP64=1 python -m benchmarks.moe.ep_family_sweep ...  # in float64
    res = run_ranks(sweep_worker, 2, ["deepseek_v3", "gpt_oss"])[0]   # {model_type: {"status": ..., ...}}

Counts: exact / refused (one line naming the module and what differs) / mismatched / skipped (with the reason) / dense
(no MoE block, out of scope), the share exact among the MoE families in scope (exact + refused + mismatched) and the
wall time.

A plain user loop over 2 ranks, each with its own batch: apply_expert_parallel(model) (ep = dp = 2), loss, backward,
the data-parallel reduction (replicated grads: mean over the ranks; experts: reduce_dp_grads), SGD step. Against the
unsharded model run by every rank on its own batch (grads averaged over the ranks): each rank's loss and every
gradient (experts: this rank's slice), before and after one SGD step, within 1e-4 relative (max |a - b| / max |b| per
tensor), in float32 (EP_SWEEP_FP64=1: float64). The aux loss is in the loss where the config has
output_router_logits (switched on). Each type ends exact, refused (apply_expert_parallel's one-line ValueError),
mismatched, dense (no MoE block: out of scope) or skipped (tiny config not buildable, the reason kept).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from benchmarks.common.launch import results_dir
from benchmarks.tensor_parallel.family_sweep import (
    ENCODER_STYLE,
    STATE_SPACE,
    batch,
    report,
    sweep,
    tiny_config,
    vocab,
    worst_then_sgd,
)

TOL = 1e-4
LR = 0.1
DTYPE = torch.float64 if os.environ.get("EP_SWEEP_FP64") else torch.float32


def build(model_type: str, layers: int = 2):
    """The TP sweep's tiny model (eager attention and experts, seed 0), in DTYPE, train mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, layers)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > 20_000_000:
        raise ValueError(f"the tiny config still has {n / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", attn_implementation="eager")
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    for name, buf in model.named_buffers():  # routing corrections (DeepSeek-V3's e_score_correction_bias, LFM2-MoE's
        if buf.is_floating_point() and name.rpartition(".")[2].endswith("bias"):  # expert_bias): zero at init,
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)  # a checkpoint's move the routing: exercised
    return model.to(DTYPE).train()


def _is_moe(model) -> bool:
    """MoE blocks found, or expert parameters of another layout (DBRX's 2-D expert tensors: refused, not dense)."""
    from hfpar.parallel.expert_parallel.hf_experts import find_hf_experts
    from hfpar.parallel.expert_parallel.moe import MoELayer

    found, problems = find_hf_experts(model)
    experts = any("experts" in name.split(".") for name, _ in model.named_parameters())
    return bool(found or problems or experts) or any(
        isinstance(m, MoELayer) or "moe" in type(m).__name__.lower() for m in model.modules()
    )


def _reduced_grads(model, ref) -> tuple[dict, dict]:
    """(EP model's grads after the dp reduction, the reference's grads averaged over the ranks, expert slices)."""
    from hfpar.parallel.sharding import reduce_dp_grads, shard_spec, shard_tensor

    ws = dist.get_world_size()
    got, want = {}, {}
    for m in (model, ref):  # the same collectives on every rank: a parameter no
        for p in m.parameters():  # token of this rank reached has a zero grad here
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    experts = [p for p in model.parameters() if shard_spec(p) is not None and shard_spec(p).kind == "ep"]
    reduce_dp_grads(experts)
    refp = dict(ref.named_parameters())
    for p in refp.values():  # the reference's data-parallel mean, in place
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(ws)
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        s = shard_spec(p)
        if s is None or s.kind != "ep":
            dist.all_reduce(p.grad)
            p.grad.div_(ws)
        g = refp[n].grad
        if g is not None and s is not None and s.kind == "ep":  # this rank's rows (of each packed part)
            g = shard_tensor(g, s.dim, dist.get_rank(s.group), s.size, s.packed_splits)
        got[n], want[n] = p.grad, g
    return got, want


def _step_compare(model, ref, ids, labels) -> tuple[float, str]:
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    ref_loss = ref(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    ref_loss.backward()
    got, want = _reduced_grads(model, ref)
    if extra := sorted(n for n in set(got) | set(want) if got.get(n) is None or want.get(n) is None):
        raise AssertionError(f"grads missing on one side: {extra[:4]}")
    return worst_then_sgd(model, ref, loss, ref_loss, got, want, LR)


def check(model_type: str) -> dict:
    from hfpar.parallel.expert_parallel import (
        apply_expert_parallel,
        expert_parallel_groups,
    )

    if model_type in ENCODER_STYLE or model_type in STATE_SPACE:
        return {"status": "skipped", "why": "encoder-style / multimodal / pure state-space"}
    for layers in (2, 4):
        try:
            model = build(model_type, layers=layers)
        except Exception as e:  # noqa: BLE001 - a family whose tiny config does not build is skipped with the reason
            why = f"tiny model does not build: {type(e).__name__}: {str(e)[:160]}"
            continue
        if not _is_moe(model):
            return {"status": "dense"}
        cfg = model.config.get_text_config()
        if hasattr(cfg, "output_router_logits"):
            cfg.output_router_logits = model.config.output_router_logits = True
        ref = copy.deepcopy(model)
        ids, labels = batch(vocab(model), seed=1 + dist.get_rank())
        try:
            ref(input_ids=ids, labels=labels, use_cache=False).loss.backward()
            ref.zero_grad(set_to_none=True)
            break
        except Exception as e:  # noqa: BLE001
            why = f"unsharded tiny model does not train: {type(e).__name__}: {str(e)[:160]}"
    else:
        return {"status": "skipped", "why": why}
    t0 = time.perf_counter()
    try:
        ep_group, edp_group = expert_parallel_groups(dist.get_world_size())  # collective
        apply_expert_parallel(model, ep_group, edp_group=edp_group)
    except ValueError as e:
        return {"status": "refused", "why": str(e)}
    apply_s = time.perf_counter() - t0
    how = (
        "hf_block" if any(hasattr(m, "_hfpar_ep") and m._hfpar_ep is not None for m in model.modules()) else "moe_layer"
    )
    try:
        (worst, name) = max(_step_compare(model, ref, ids, labels), _step_compare(model, ref, ids, labels))
    except Exception as e:  # noqa: BLE001
        return {
            "status": "mismatched",
            "why": f"{type(e).__name__}: {str(e)[:300]}",
            "trace": traceback.format_exc()[-600:],
        }
    return {
        "status": "exact" if worst < TOL else "mismatched",
        "worst_rel": worst,
        "worst": name,
        "how": how,
        "apply_s": round(apply_s, 3),
    }


def sweep_worker(rank: int, world_size: int, types: list[str], verbose: bool = False) -> dict:
    """check() every type on this rank (run_ranks); rank 0 prints a line per type when verbose."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    res = {}
    for mt in types:
        t0 = time.perf_counter()
        if rank == 0 and os.environ.get("EP_SWEEP_LOG"):  # where a run is, while it runs
            with open(os.environ["EP_SWEEP_LOG"], "a") as f:
                f.write(f"{mt}\n")
        res[mt] = check(mt)
        res[mt]["s"] = round(time.perf_counter() - t0, 2)
        if rank == 0 and verbose and res[mt]["status"] != "dense":
            r = res[mt]
            worst = f"{r['worst_rel']:.1e}" if "worst_rel" in r else ""
            print(
                f"{mt:28s} {r['status']:10s} {r.get('how', '')!s:9s} {worst:8s} "
                f"{r.get('worst', '')} {r.get('why', '')[:260]}",
                flush=True,
            )
        dist.barrier()
    return res


def main(argv: list[str]) -> dict:
    summary = sweep(sweep_worker, argv, ("exact", "refused", "mismatched", "skipped", "dense"))
    summary.update(tol=TOL, dtype=str(DTYPE))
    return report(summary, results_dir("moe") / "ep_family_sweep.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
