"""hfpar.parallel.expert_parallel: expert parallelism on tiny HF MoE models, and dense -> MoE upcycling.

    python -m pytest tests/distributed/test_ep_models.py -q

One spawn of 4 gloo ranks runs every parity case. Each data-parallel rank gets DIFFERENT tokens (with
padding, published to the routers by attach_moe_token_mask). The reference is the same model with
hfpar layers at ep=1 run in one process on the concatenation of the dp group's batches (checked
against the original HF model's logits and transformers' load_balancing_loss_func on the same tokens).
Per rank: logits, sum-CE loss, input-embedding grads, every layer's aux / z loss; after reduction
(router and all other replicated grads summed over dp; expert grads summed over the expert-data-
parallel group) every grad equals the reference; one SGD step with grad / dp on both sides gives the
same weights (gather_expert_state_dict == reference state dict), and the exported checkpoint loads
with from_pretrained on rank 0 and gives the reference's logits. Cases: Mixtral ep=4 and ep=2 over
dp=4, Qwen2-MoE (shared expert) ep=2 over dp=4 and over two dp groups of 2, an upcycled Llama at
ep=2 exported as Mixtral. Validation errors are checked in this process with a mocked world size
(no process group: any collective would fail) and once for real on the 4 ranks.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.parallel.sharding import shard_spec
from tests.helpers.dist import run_distributed, value_error_message
from tests.helpers.ep_models import MOE, TINY, TOL, _batch, _build, _rel

AUX, Z = 0.1, 0.01  # large enough to show in the gradients
# (name, model_type, ep, dp groups (None = the world), dtype, export)
CASES = [
    ("mixtral-ep4", "mixtral", 4, None, "float64", True),
    ("mixtral-ep2-dp4", "mixtral", 2, None, "float64", False),
    ("mixtral-ep4-fp32", "mixtral", 4, None, "float32", False),
    ("qwen2_moe-ep2-dp4", "qwen2_moe", 2, None, "float64", True),
    ("qwen2_moe-ep2-dp2x2", "qwen2_moe", 2, [[0, 1], [2, 3]], "float64", False),
    ("upcycled-llama-ep2", "llama", 2, None, "float64", True),
]


def _sum_ce(logits, ids, mask):
    """Sum of next-token CE over real target tokens (not a mean: ranks hold different token counts)."""
    tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), tgt.reshape(-1), reduction="sum")


def _forward(model, ids, mask, explicit_mask: bool):
    """logits, embedding output (grad retained); with explicit_mask the MoE mask is set by hand."""
    from hfpar.parallel.expert_parallel import moe_token_mask

    emb = model.get_input_embeddings()(ids)
    emb.retain_grad()
    if explicit_mask:
        with moe_token_mask(mask):
            return model(inputs_embeds=emb, attention_mask=mask).logits, emb
    return model(inputs_embeds=emb, attention_mask=mask).logits, emb


def _routers(model):
    from hfpar.parallel.expert_parallel.moe import MoELayer

    return [m.gate for m in model.modules() if isinstance(m, MoELayer)]


# ----------------------------------------------------------------------------- one parity case
def _parity_case(rank: int, case, self_group, outdir: str) -> dict:
    from hfpar.parallel.comm import all_reduce
    from hfpar.parallel.expert_parallel import (
        apply_expert_parallel,
        attach_moe_token_mask,
        expert_parallel_groups,
        expert_parameters,
        gather_expert_state_dict,
        non_expert_parameters,
        save_upcycled_pretrained,
        upcycle_to_moe,
        upcycled_hf_config,
    )

    name, mt, ep, dp_lists, dtype, export = case
    world = dist.get_world_size()
    dp_lists = dp_lists or [list(range(world))]
    dp_groups = [dist.new_group(d) if len(dp_lists) > 1 else dist.group.WORLD for d in dp_lists]
    mine = next(i for i, d in enumerate(dp_lists) if rank in d)
    dp_ranks, dp_group, dp = dp_lists[mine], dp_groups[mine], len(dp_lists[mine])
    ep_group, edp_group = expert_parallel_groups(ep, dp_lists)
    res: dict = {}

    base = _build(mt, dtype)
    batches = [_batch(r) for r in dp_ranks]  # the dp group's batches; mine at my index
    ids, mask = batches[dp_ranks.index(rank)]
    ids_all, mask_all = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    if mt in MOE:  # reference: hfpar layers at ep=1, statistics over this process's tokens only
        hf = copy.deepcopy(base)
        ref = apply_expert_parallel(
            copy.deepcopy(base), self_group, dp_group=self_group, aux_loss_coef=AUX, z_loss_coef=Z
        )
        coefs = dict(aux_loss_coef=AUX, z_loss_coef=Z)
    else:  # upcycled dense model; ref is the upcycled model itself (ep=1, router group None)
        dense = base
        with torch.no_grad():
            dense_logits = dense(ids, attention_mask=mask).logits
        base = upcycle_to_moe(copy.deepcopy(dense), num_experts=4, top_k=2, aux_loss_coef=AUX, z_loss_coef=Z, seed=0)
        with torch.no_grad():
            res["upcycle_init_rel"] = _rel(base(ids, attention_mask=mask).logits, dense_logits)
        ref = copy.deepcopy(base)
        coefs = {}
    model = apply_expert_parallel(copy.deepcopy(base), ep_group, dp_group=dp_group, edp_group=edp_group, **coefs)
    handle = attach_moe_token_mask(model)

    # ---- reference: one process, all of the dp group's tokens, grad_scale 1 (coef * aux added once)
    ref_logits, ref_emb = _forward(ref, ids_all, mask_all, explicit_mask=True)
    ref_losses = [
        _sum_ce(ref_logits[2 * i : 2 * i + 2], ids_all[2 * i : 2 * i + 2], mask_all[2 * i : 2 * i + 2])
        for i in range(dp)
    ]
    torch.stack(ref_losses).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    me = slice(2 * dp_ranks.index(rank), 2 * dp_ranks.index(rank) + 2)
    if mt in MOE:  # the ep=1 hfpar model IS the HF model, aux loss included
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        with torch.no_grad():
            out = hf(ids_all, attention_mask=mask_all, output_router_logits=True)
        res["hf_logits_rel"] = _rel(ref_logits.detach(), out.logits)
        res["hf_aux_rel"] = max(
            abs(load_balancing_loss_func((rl,), 4, 2, mask_all).item() - r.last_aux_loss.item())
            / r.last_aux_loss.item()
            for rl, r in zip(out.router_logits, _routers(ref))
        )

    # ---- expert-parallel model: my tokens only
    logits, emb = _forward(model, ids, mask, explicit_mask=False)
    loss = _sum_ce(logits, ids, mask)
    loss.backward()
    handle.remove()
    res["logits_rel"] = _rel(logits.detach(), ref_logits[me].detach())
    res["loss_rel"] = abs(loss.item() - ref_losses[dp_ranks.index(rank)].item()) / ref_losses[0].item()
    res["input_grad_rel"] = _rel(emb.grad, ref_emb.grad[me])
    res["aux_rel"] = max(
        abs(a.last_aux_loss.item() - b.last_aux_loss.item()) / b.last_aux_loss.item()
        for a, b in zip(_routers(model), _routers(ref))
    )
    res["z_rel"] = max(
        abs(a.last_z_loss.item() - b.last_z_loss.item()) / b.last_z_loss.item()
        for a, b in zip(_routers(model), _routers(ref))
    )
    res["n_moe"] = len(_routers(model))
    spec = shard_spec(model.model.layers[0].mlp.experts.gate_up_proj)
    res["ep_meta"] = (model.model.layers[0].mlp.ep_size, spec.dp_size if spec is not None else dp)
    experts = {id(p) for p in expert_parameters(model)}
    res["n_expert_params"] = len(experts)
    res["partition_ok"] = len(experts) + sum(1 for _ in non_expert_parameters(model)) == sum(
        1 for _ in model.parameters()
    )
    res["local_experts"] = model.model.layers[0].mlp.experts.gate_up_proj.shape[0]

    # ---- reduction: replicated grads SUM over dp, expert grads SUM over the expert-data-parallel group
    worst, reduced = (0.0, ""), {}
    for n, p in model.named_parameters():
        meta = shard_spec(p)
        if meta is None or meta.kind != "ep":
            g, want = all_reduce(p.grad, dp_group), ref_grads[n]
        else:
            g = all_reduce(p.grad, meta.dp_reduce_group) if dp // ep > 1 else p.grad.clone()
            want = ref_grads[n][meta.extra["start"] : meta.extra["start"] + p.shape[0]]
        reduced[n] = g
        worst = max(worst, (_rel(g, want), n))
    res["grad_worst"] = worst
    # ---- one SGD step with the dp-mean convention (every reduced grad / dp) on both sides
    lr = 0.1
    with torch.no_grad():
        for n, p in model.named_parameters():
            p -= lr * reduced[n] / dp
        for n, p in ref.named_parameters():
            p -= lr * p.grad / dp
    sd, ref_sd = gather_expert_state_dict(model), ref.state_dict()
    res["sd_keys_match"] = sorted(sd) == sorted(ref_sd)
    res["sd_worst"] = max((_rel(sd[k], ref_sd[k]), k) for k in ref_sd)
    if not export:
        return res

    # ---- export: a standard checkpoint (gathered on every rank, written and loaded by rank 0)
    path = os.path.join(outdir, name)
    if mt in MOE:
        if rank == 0:
            model.save_pretrained(path, state_dict=sd)
    else:
        cfg = upcycled_hf_config(model)
        res["export_cfg"] = (
            cfg.model_type,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            cfg.router_aux_loss_coef,
            cfg.intermediate_size,
        )
        save_upcycled_pretrained(model, path)  # collective gather; rank 0 writes
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), experts_implementation="eager"
        ).eval()
        ref.eval()
        with torch.no_grad():
            res["export_class"] = type(loaded).__name__
            res["export_logits_rel"] = _rel(
                loaded(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
            )
    dist.barrier()
    return res


def _worker(rank: int, world_size: int, outdir: str) -> dict:
    from hfpar.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    self_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    results = {"parity": {c[0]: _parity_case(rank, c, self_groups[rank], outdir) for c in CASES}}
    # validation for real (ep=4): every rank raises before any collective, so ranks stay in step
    results["err_div"] = value_error_message(lambda: apply_expert_parallel(_build("mixtral", num_local_experts=6)))
    model = _build("mixtral")  # different weights on one rank
    if rank == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.gate.weight[2, 3] += 1e-3
    results["err_weights"] = value_error_message(lambda: apply_expert_parallel(model))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    results["in_step"] = t.item()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("ep_export")), timeout=240)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parity(ranks, case):
    name, mt, ep, dp_lists, dtype, export = case
    tol = TOL[dtype]
    for rank, res in enumerate(ranks):
        r = res["parity"][name]
        if mt in MOE:
            assert r["hf_logits_rel"] < tol and r["hf_aux_rel"] < tol, (r["hf_logits_rel"], r["hf_aux_rel"])
        else:
            assert r["upcycle_init_rel"] < tol, r["upcycle_init_rel"]
        assert r["logits_rel"] < tol and r["loss_rel"] < tol, (rank, r["logits_rel"], r["loss_rel"])
        assert r["input_grad_rel"] < tol, (rank, r["input_grad_rel"])
        assert r["aux_rel"] < tol and r["z_rel"] < tol, (rank, r["aux_rel"], r["z_rel"])
        assert r["grad_worst"][0] < tol, (rank, r["grad_worst"])
        assert r["sd_keys_match"] and r["sd_worst"][0] < tol, (rank, r["sd_worst"])
        assert r["n_moe"] == TINY["num_hidden_layers"]
        assert r["local_experts"] == 4 // ep and r["ep_meta"] == (ep, len((dp_lists or [range(4)])[0]))
        assert r["n_expert_params"] == 2 * TINY["num_hidden_layers"] and r["partition_ok"]
    if export:
        r0 = ranks[0]["parity"][name]
        want = {"llama": "MixtralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[mt]
        assert r0["export_class"] == want, r0["export_class"]
        assert r0["export_logits_rel"] < tol, r0["export_logits_rel"]
        if mt == "llama":
            assert r0["export_cfg"] == ("mixtral", 4, 2, AUX, TINY["intermediate_size"])


def test_errors_on_ranks(ranks):
    for res in ranks:
        assert "model.layers.0.mlp: num_experts 6 is not divisible by ep_size 4" in res["err_div"], res["err_div"]
        assert "model.layers.1.mlp: num_experts 6" in res["err_div"]
        assert "model.layers.1.mlp router / expert weights differ" in res["err_weights"], res["err_weights"]
        assert res["in_step"] == 10.0
