"""Expert parallelism composed with context parallelism: EP=2 drawn from the cp ranks (cp=2, dp=1), 2 gloo ranks.

    python -m pytest tests/distributed/test_ep_cp.py -q

The glue the recipes use, without a launch: ParallelContext(ep=2, cp=2) (EP groups run over the dp x cp ranks, so
here the EP group is the cp group), apply_expert_parallel(model, ctx), hfpar's CP attention (ring and Ulysses), the
row cut of BatchPlan (shift_labels, shard_batch, cp_rows, moe_token_mask of this rank's tokens). Each cp rank routes
the tokens of its part of the sequence, and the all-to-all sends them to the rank holding their experts.
Families: Mixtral (hfpar's MoELayer, with hfpar's global aux loss, whose statistics span every token of dp x cp)
and DeepSeek-V3 (MLA attention; the HF block's own sigmoid, bias-corrected, group-limited router with a shared
expert, only its experts sharded: hf_experts.py). Padding in the batch (no part in routing statistics or loss).
Reference: the unsharded model with stock SDPA attention, one process, the whole batch; the loss normalized by the
batch's target tokens. Per rank, float64: the summed loss over the cp ranks equals the reference's, and after the
backends' reduction (replicated grads: mean over dp x cp of the loss scaled by dp x cp; experts: reduce_dp_grads,
which divides by dp x cp) every gradient (experts: this rank's slice) equals the reference's within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.context import ParallelContext
from hfpar.parallel.context_parallel import cp_rows, register_cp_attention, shard_batch, shift_labels
from hfpar.parallel.expert_parallel import apply_expert_parallel, moe_token_mask, set_aux_loss_grad_scale
from hfpar.parallel.sharding import reduce_dp_grads, shard_spec
from tests.helpers.dist import run_distributed

T, V = 16, 64
TOL = 1e-6
AUX = 0.1  # hfpar's global aux loss on Mixtral: large enough to show in the router's gradient
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": V,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}
FAMILIES = {  # name: (model_type, config overrides, aux_loss_coef)
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, AUX),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
        None,
    ),
}


def _model(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**TINY, **extra})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    for m in model.modules():  # a non-zero correction bias (DeepSeek-V3), so that selection depends on it
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.data.copy_(torch.linspace(-0.05, 0.05, m.e_score_correction_bias.numel()))
    return model.double().train()


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # padding on the right of row 1
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_sum(logits, shifted):
    return F.cross_entropy(logits.reshape(-1, V), shifted.reshape(-1), ignore_index=-100, reduction="sum")


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(rank: int, world: int) -> dict:
    ctx = ParallelContext.plan(world, rank, ep=2, cp=2).build_groups()
    assert ctx.dp == 1 and ctx.ep_rank == ctx.cp_rank
    assert sorted(dist.get_process_group_ranks(ctx.ep_group)) == sorted(dist.get_process_group_ranks(ctx.cp_group))
    own = [dist.new_group([r]) for r in range(world)][rank]  # the reference's one-rank groups (ep = dp = 1)
    batch = _batch()
    shifted = shift_labels(batch)
    n = int((shifted["labels"] != -100).sum())
    R = ctx.grad_replicas  # dp x cp: the backends average replicated grads over it
    out = {}
    for name, (_, _, aux) in FAMILIES.items():
        ref = apply_expert_parallel(_model(name), own, dp_group=own, edp_group=own, aux_loss_coef=aux)
        set_aux_loss_grad_scale(1.0)
        with moe_token_mask(batch["attention_mask"]):
            logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ref_loss = _loss_sum(logits, shifted["labels"]) / n
            ref_loss.backward()
        ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
        for mode in ("ring", "ulysses"):
            model = apply_expert_parallel(_model(name), ctx, aux_loss_coef=aux)
            model.set_attn_implementation(register_cp_attention())
            experts = [p for p in model.parameters() if shard_spec(p) is not None and shard_spec(p).kind == "ep"]
            assert experts, name
            set_aux_loss_grad_scale(R)
            local, rows = shard_batch(shifted, ctx.cp_rank, ctx.cp)
            with cp_rows(rows, ctx.cp_group, mode), moe_token_mask(local["attention_mask"]):
                logits = model(
                    input_ids=local["input_ids"],
                    attention_mask=local["attention_mask"],
                    position_ids=local["position_ids"],
                ).logits
                loss = _loss_sum(logits, local["labels"]) / n
                (loss * R).backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=ctx.cp_group)
            worst = (_rel(total, ref_loss.detach()), "loss")
            for p in model.parameters():  # a parameter no local token reached: a zero grad
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            reduce_dp_grads(experts)
            for k, p in model.named_parameters():
                spec = shard_spec(p)
                want = ref_grads.get(k, torch.zeros_like(p))
                if spec is not None and spec.kind == "ep":
                    want = want[spec.extra["start"] : spec.extra["start"] + p.shape[0]]
                else:
                    dist.all_reduce(p.grad, group=ctx.replica_group)
                    p.grad.div_(R)
                worst = max(worst, (_rel(p.grad, want), k))
            out[f"{name}-{mode}"] = worst
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_check, 2, timeout=600)


@pytest.mark.parametrize("case", [f"{f}-{m}" for f in FAMILIES for m in ("ring", "ulysses")])
def test_ep_cp_matches_the_unsharded_model(ranks, case):
    for rank, res in enumerate(ranks):
        worst = res[case]
        print(f"EPCP {case} rank {rank}: max relative difference {worst[0]:.2e} ({worst[1]})")  # pytest -s
        assert worst[0] <= TOL, (rank, case, worst)
