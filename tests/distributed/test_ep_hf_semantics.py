"""apply_expert_parallel keeps the HF model's semantics: `model(**batch, labels=...).loss`, output_router_logits,
aux_loss / router_logits fields; activation checkpointing; generic detection; the Accelerate example.

    python -m pytest tests/distributed/test_ep_hf_semantics.py -q          # the example test is marked slow

One spawn of 2 gloo ranks (fp32) runs every case. Per family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE from the table;
FlexOlmo, MiniMax, GraniteMoE detected generically) and per output_router_logits (False, True by call,
True by config): EP=2 over the 2 ranks, each rank a different padded batch with labels. The reference is the
UNSHARDED HF model with its own MoE blocks, in one process: loss of each rank's batch, one SGD step on the mean
of the two losses (the data-parallel objective), loss after the step. The EP model's loss, aux_loss and number
of router_logits before, its loss after one SGD step (grads: replicated mean over ranks, experts reduce_dp_grads)
and every gathered weight after it must match within 1e-4 (measured: losses within 1.4e-7, weights within
3.4e-7). Sensitivity: the same step with the other objective (aux on <-> off) moves the weights by 2.4e-2 to
1.1e-1 relative, far more than the tolerance, so a wrong objective fails.
Also: hfpar's global aux loss (aux_loss_coef=...) called with output_router_logits=True returns router logits
but takes the aux gradient once; activation checkpointing (reentrant and not, token mask from
attach_moe_token_mask, padding in the batch) gives the grads of the run without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed

TOL = 1e-4
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "router_aux_loss_coef": 0.1,
}  # large enough to move one SGD step visibly
MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    # detected generically (no MOE_FAMILIES entry)
    "flex_olmo": {"num_experts": 4, "num_experts_per_tok": 2},
    "minimax": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
ORL = [False, True, "config"]  # output_router_logits: call kwarg False / True; config True
LR = 0.5


def _build(mt: str, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(mt, **{**TINY, **MOE[mt], **over})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").float().train()


def _batch(seed: int) -> dict:
    """(2, 8) ids, right padding of a seed-dependent length, labels -100 on padding."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4 + seed % 3 :] = 0
    return {
        "input_ids": ids.masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _sgd(model, lr: float = LR) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def _dp_reduce(model, world: int) -> None:
    from hfpar.parallel.expert_parallel import expert_parameters, non_expert_parameters
    from hfpar.parallel.sharding import reduce_dp_grads

    reduce_dp_grads(expert_parameters(model))  # experts: their grads hold both ranks' tokens; / dp
    for p in non_expert_parameters(model):
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _weights_rel(model, ref) -> tuple[float, str]:
    from hfpar.parallel.expert_parallel import gather_expert_state_dict

    sd, want = gather_expert_state_dict(model), gather_expert_state_dict(ref)  # ref: HF (full) or EP
    assert sorted(sd) == sorted(want)
    return max((_rel(sd[k], want[k]), k) for k in want)


def _reference(hf, batches, kw) -> tuple:
    """Unsharded HF model: outputs on each batch, one SGD step on their mean loss, losses after."""
    ref = copy.deepcopy(hf)
    outs = [ref(**b, **kw) for b in batches]
    (sum(o.loss for o in outs) / len(outs)).backward()
    _sgd(ref)
    with torch.no_grad():
        after = [ref(**b, **kw).loss.item() for b in batches]
    return ref, outs, after


def _hf_case(rank: int, world: int, mt: str, orl) -> dict:
    from hfpar.parallel.expert_parallel import apply_expert_parallel
    from hfpar.parallel.expert_parallel.moe import MoELayer

    hf = _build(mt, output_router_logits=orl == "config")
    kw = {} if orl == "config" else {"output_router_logits": orl}
    batches = [_batch(r) for r in range(world)]
    ref, ref_outs, ref_after = _reference(hf, batches, kw)
    # sensitivity: the other objective (aux on <-> off) after the same step
    other, _, _ = _reference(_build(mt, output_router_logits=orl is False), batches, {})
    res = {"aux_effect": max(_rel(a, b) for a, b in zip(ref.state_dict().values(), other.state_dict().values()))}

    model = apply_expert_parallel(copy.deepcopy(hf))  # EP=2 over the world, the HF objective
    res["n_moe"] = sum(isinstance(m, MoELayer) for m in model.modules())
    res["local_experts"] = next(m for m in model.modules() if isinstance(m, MoELayer)).experts.gate_up_proj.shape[0]
    out = model(**batches[rank], **kw)
    want = ref_outs[rank]
    res["loss"] = (out.loss.item(), want.loss.item())
    res["aux"] = tuple(None if o.aux_loss is None else o.aux_loss.item() for o in (out, want))
    res["n_router_logits"] = tuple(len(o.router_logits or ()) for o in (out, want))
    out.loss.backward()
    _dp_reduce(model, world)
    _sgd(model)
    with torch.no_grad():
        res["after"] = (model(**batches[rank], **kw).loss.item(), ref_after[rank])
    res["weights"] = _weights_rel(model, ref)
    return res


def _global_aux_case(rank: int, world: int) -> dict:
    """hfpar's global aux loss, called with output_router_logits=True: fields returned, aux gradient taken once."""
    from hfpar.parallel.expert_parallel import (
        apply_expert_parallel,
        attach_moe_token_mask,
    )

    res, models = {}, []
    for orl in (False, True):
        model = apply_expert_parallel(_build("mixtral", output_router_logits=True), aux_loss_coef=0.1)
        attach_moe_token_mask(model)
        res["config_switched_off"] = not model.config.output_router_logits
        out = model(**_batch(rank), output_router_logits=orl)
        if orl:
            res["n_router_logits"] = len(out.router_logits)
            res["aux_requires_grad"] = out.aux_loss.requires_grad
        out.loss.backward()
        _dp_reduce(model, world)
        _sgd(model)
        models.append(model)
    res["once"] = _weights_rel(models[1], models[0])
    return res


def _checkpointing_case(rank: int, world: int, coef, orl: bool) -> dict:
    """Same EP model with and without activation checkpointing: weights after one step (all grads) agree."""
    from hfpar.parallel.expert_parallel import (
        apply_expert_parallel,
        attach_moe_token_mask,
    )

    models = {}
    for gc in (None, "non_reentrant", "reentrant"):
        model = apply_expert_parallel(_build("mixtral"), aux_loss_coef=coef)
        attach_moe_token_mask(model)
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc == "reentrant"})
        model(**_batch(rank), output_router_logits=orl).loss.backward()
        _dp_reduce(model, world)
        _sgd(model)
        models[gc] = model
    # HF-mode aux under reentrant checkpointing has no gradient, as in HF itself (router logits from a no-grad
    # forward): compared only where hfpar injects the aux loss
    modes = ["non_reentrant", "reentrant"] if coef is not None else ["non_reentrant"]
    return {gc: _weights_rel(models[gc], models[None]) for gc in modes}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {"hf": {f"{mt}-{orl}": _hf_case(rank, world, mt, orl) for mt in MOE for orl in ORL}}
    out["global_aux"] = _global_aux_case(rank, world)
    out["checkpointing"] = {
        "global_aux": _checkpointing_case(rank, world, 0.1, False),
        "hf_aux": _checkpointing_case(rank, world, None, True),
    }
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout=400)


@pytest.mark.parametrize("orl", ORL, ids=[f"orl={o}" for o in ORL])
@pytest.mark.parametrize("mt", list(MOE))
def test_matches_unsharded_hf_model(ranks, mt, orl):
    for rank, res in enumerate(ranks):
        r = res["hf"][f"{mt}-{orl}"]
        assert r["n_moe"] == TINY["num_hidden_layers"] and r["local_experts"] == 2, (r["n_moe"], r["local_experts"])
        for key in ("loss", "after"):
            got, want = r[key]
            assert abs(got - want) <= TOL * abs(want), (rank, key, got, want)
        if orl:
            got, want = r["aux"]
            assert abs(got - want) <= TOL * abs(want), (rank, "aux_loss", got, want)
            assert r["n_router_logits"] == (TINY["num_hidden_layers"],) * 2, r["n_router_logits"]
        else:
            assert r["aux"] == (None, None) and r["n_router_logits"] == (0, 0), (r["aux"], r["n_router_logits"])
        assert r["weights"][0] <= TOL, (rank, r["weights"])
        assert r["aux_effect"] > 100 * TOL, (rank, "aux loss too small to test", r["aux_effect"])


def test_global_aux_loss_counted_once(ranks):
    for res in ranks:
        r = res["global_aux"]
        assert r["config_switched_off"] and r["n_router_logits"] == 2 and not r["aux_requires_grad"], r
        assert r["once"][0] <= 1e-6, r["once"]


@pytest.mark.parametrize("case", ["global_aux", "hf_aux"])
def test_activation_checkpointing(ranks, case):
    for res in ranks:
        for gc, (rel, name) in res["checkpointing"][case].items():
            assert rel <= 1e-6, (case, gc, rel, name)


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_grads_match_hf_model(reentrant):
    """output_router_logits=True under activation checkpointing: the grads of HF's own model (with reentrant
    checkpointing HF's router logits come from a no-grad forward, so its aux term has no gradient: so has ours)."""
    from hfpar.parallel.expert_parallel import apply_expert_parallel, attach_moe_token_mask

    hf = _build("mixtral")
    model = apply_expert_parallel(copy.deepcopy(hf))
    attach_moe_token_mask(model)
    grads = []
    for m in (hf, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m(**_batch(0), output_router_logits=True).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    worst = max((_rel(grads[1][n], g), n) for n, g in grads[0].items())
    assert worst[0] <= TOL, worst


@pytest.mark.parametrize(
    "mt, over, kw, message",
    [
        (
            "deepseek_v3",
            {
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 0,
                "kv_lora_rank": 16,
                "q_lora_rank": None,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 8,
                "num_key_value_heads": 4,
            },
            {"aux_loss_coef": 0.1},
            (
                r"^apply_expert_parallel: model\.layers\.0\.mlp\.experts \(DeepseekV3MoE\) keeps the HF block's own "
                r"router, "
                r"so aux_loss_coef=0\.1 \(hfpar's router\) cannot apply; pass None"
            ),
        ),
        (
            "gpt_oss",
            {"num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["full_attention"] * 2},
            {"capacity_factor": 1.25},
            r"^apply_expert_parallel: model\.layers\.0\.mlp\.experts \(GptOssMLP\) keeps .* so capacity_factor=1\.25",
        ),
    ],
)
def test_hf_blocks_without_ep_stay_hf_and_refusals_are_one_line(mt, over, kw, message):
    """Blocks hfpar's MoELayer does not reproduce (a bias-corrected sigmoid router, biased transposed experts) keep
    the HF block's own code (hf_experts.py; EP=2 parity: tests/distributed/test_ep_family_sweep.py): in one process
    the router and the rest stay HF's, plain SwiGLU experts (DeepSeek-V3) run hfpar's CPU kernel (equal to
    round-off), others (GPT-OSS) are untouched; what needs hfpar's router (its aux loss, a capacity) is refused in
    one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **{**TINY, **over}))
    experts = type(model.model.layers[0].mlp.experts)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    assert apply_expert_parallel(model) is model
    sped_up = type(model.model.layers[0].mlp.experts)
    if mt == "deepseek_v3":
        assert sped_up is not experts and issubclass(sped_up, experts)
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    else:
        assert sped_up is experts
        assert torch.equal(model(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match=message) as e:
        apply_expert_parallel(model, **kw)
    assert "\n" not in str(e.value)


def test_global_aux_loss_is_the_sum_of_per_layer_losses():
    """What apply_expert_parallel(aux_loss_coef=c) trains, as docs/own-code.md states it (one process, fp32, no
    padding, 2 MoE layers): the gradient of CE + c * sum over layers of load_balancing_loss_func(that layer's
    logits), not of HF's pooled loss (which differs by far more than the tolerance, so the test can tell them
    apart); called with output_router_logits=True, the returned loss is CE + router_aux_loss_coef * HF's pooled
    aux as a value, and the gradient is unchanged (taken once)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from hfpar.parallel.expert_parallel import apply_expert_parallel

    c, E, k = 0.3, MOE["mixtral"]["num_local_experts"], MOE["mixtral"]["num_experts_per_tok"]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def grads(model) -> dict:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    hf = _build("mixtral")
    hf_ep = copy.deepcopy(hf)
    ref = hf(**batch, output_router_logits=True)
    per_layer = sum(load_balancing_loss_func((logits,), E, k) for logits in ref.router_logits)
    pooled = load_balancing_loss_func(ref.router_logits, E, k)
    ce = ref.loss - TINY["router_aux_loss_coef"] * ref.aux_loss
    torch.autograd.backward(ce + c * per_layer, retain_graph=True)
    want_sum = grads(hf)
    hf.zero_grad()
    torch.autograd.backward(ce + c * pooled)
    want_pooled = grads(hf)

    ours = apply_expert_parallel(hf_ep, aux_loss_coef=c)
    got, loss = {}, {}
    for orl in (False, True):
        ours.zero_grad()
        out = ours(**batch, output_router_logits=orl)
        out.loss.backward()
        got[orl], loss[orl] = grads(ours), out.loss.item()
        if orl:
            assert not out.aux_loss.requires_grad
            assert abs(out.aux_loss.item() - pooled.item()) <= 1e-6 * pooled.item(), (out.aux_loss, pooled)
    assert abs(loss[False] - ce.item()) <= 1e-6 * ce.item(), (loss[False], ce.item())
    assert abs(loss[True] - (ce + TINY["router_aux_loss_coef"] * pooled).item()) <= 1e-6 * loss[True]

    gate = [n for n in want_sum if ".gate." in n or n.endswith(".gate.weight")]
    assert len(gate) == TINY["num_hidden_layers"], gate

    def rel(a: dict, b: dict, names) -> float:
        return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in names)

    for orl in (False, True):
        assert rel(got[orl], want_sum, gate) <= 1e-5, (orl, rel(got[orl], want_sum, gate))
        assert rel(got[orl], want_sum, [n for n in want_sum if n not in gate and n in got[orl]]) <= 1e-5
    assert rel(want_pooled, want_sum, gate) > 100 * 1e-5  # the pooled loss is a different objective
