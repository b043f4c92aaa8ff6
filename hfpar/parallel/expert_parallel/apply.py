"""Expert parallelism for HF mixture-of-experts models, in place (upcycle.py: dense -> MoE).

    ep_group, edp_group = expert_parallel_groups(ep_size=2)          # collective: every rank, same args
    model = AutoModelForCausalLM.from_pretrained(...)                # the SAME full weights on every rank
    apply_expert_parallel(model, ep_group, dp_group=None, edp_group=edp_group)   # None = default group
    with moe_token_mask(batch["attention_mask"]):                    # padding out of router statistics
        loss = model(**batch).loss
        loss.backward()                                              # (inside the `with` if checkpointing)
    # reduce grads: hfpar.parallel.sharding.reduce_dp_grads(expert_parameters(model)); the others: mean over dp
    model.save_pretrained(out, state_dict=gather_expert_state_dict(model))   # collective; a normal checkpoint

    dense = AutoModelForCausalLM.from_pretrained("a llama")          # llama / mistral / qwen3
    upcycle_to_moe(dense, num_experts=8, top_k=2)                    # every MLP -> 8 copies + a router
    apply_expert_parallel(dense, ep_group)                           # optional; same as above
    save_upcycled_pretrained(dense, out)                             # collective; a Mixtral checkpoint

Layout of one MoE layer after apply_expert_parallel (ep = size of ep_group, E experts, k per token):

    mlp            MoELayer (hfpar.parallel.expert_parallel.moe), same state-dict keys as the HF sparse block
      gate         TopKRouter (E, H), replicated; statistics (aux / z / capacity) over dp_group
      experts      GroupedExperts holding experts [ep_rank * E/ep, (ep_rank+1) * E/ep): (E/ep, 2I, H), (E/ep, H, I)
      shared_expert / shared_expert_gate   the HF modules themselves, replicated (Qwen2-MoE)

Architectures are data (families.py: MOE_FAMILIES); other model types are detected
generically (3-D experts + an (E, H) router, checked against the original block's output). What TopKRouter
cannot do (sigmoid / group-limited routing and routed scaling of DeepSeek-V2/V3, GLM-4-MoE; biases; sparsemixer;
Llama-4's dense experts) keeps the HF block's own code with only its experts module sharded by expert
(hf_experts.py: the experts' tensors sliced, the selected copies dispatched by all-to-all, accepted after an
equality check against the HF block; at ep = 1 experts of the plain SwiGLU layout run hfpar's CPU kernel, the
same check first); no hfpar aux / z loss or capacity there (refused in one line).

Aux loss, the objective of the HF model (aux_loss_coef=None, the default):
    output_router_logits False (config default, or call kwarg)   no aux loss, as HF
    output_router_logits True                                    the output carries router_logits and
        aux_loss, and loss includes router_aux_loss_coef * aux_loss, computed by the HF model itself from
        this process's tokens (hf_outputs.py), as HF does (under DDP: each rank its own statistics).
hfpar's global aux loss (aux_loss_coef=c, e.g. the recipes' --moe_aux_loss_coef; upcycled layers keep
theirs): the gradient of c * sum over MoE layers of aux_l, aux_l = HF's load_balancing_loss_func of that layer's
router logits alone, statistics over dp_group (every rank's tokens). The per-layer sum (Switch Transformer,
Megatron-LM), not HF's pooled loss over all layers: equal for one MoE layer, different for more. Injected in
backward (router.py, `set_aux_loss_grad_scale`), never differentiated through the returned loss;
config.output_router_logits is switched off, and a call with output_router_logits=True returns router_logits /
aux_loss as values only: HF then adds router_aux_loss_coef * aux_loss (pooled) to the returned loss as a value
(no second gradient).

Gradient reduction, padding masks, export: params.py (re-exported here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import all_gather, group_rank, group_size
from ..errors import ParallelError, Problem
from ..guard import mark_parallel, refuse_unlaunched
from ..language_model import text_config
from ..sharding import set_shard_spec, shard_spec
from .families import MOE_FAMILIES, MoEBlock, MoEFamily, config_value, find_moe_blocks
from .hf_experts import HFExperts, find_hf_experts, shard_hf_experts, speed_up_hf_experts
from .hf_outputs import record_router_logits
from .moe import GroupedExperts, MoELayer
from .params import (
    attach_moe_token_mask,
    expert_parallel_groups,
    expert_parameters,
    gather_expert_state_dict,
    non_expert_parameters,
)
from .router import TopKRouter, moe_token_mask

__all__ = [
    "MoEFamily",
    "MOE_FAMILIES",
    "apply_expert_parallel",
    "gather_expert_state_dict",
    "expert_parallel_groups",
    "expert_parameters",
    "non_expert_parameters",
    "attach_moe_token_mask",
    "moe_token_mask",
]


# ----------------------------------------------------------------------------- groups
def _default_group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _ranks(group) -> list[int] | None:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return list(dist.get_process_group_ranks(group))


# ----------------------------------------------------------------------------- apply_expert_parallel
def _validate(blocks: list[MoEBlock], ep: int, dp: int) -> list[str]:
    problems = []
    if dp % ep:
        problems.append(f"ep_size {ep} does not divide the data-parallel size {dp}")
    for b in blocks:
        where = f"{b.path}: "
        if b.fam is None:  # upcycled: shapes set by hfpar
            if b.module.ep_size > 1 or b.module.parallelized:
                problems.append(where + f"already expert-parallel (ep={b.module.ep_size})")
                continue
        else:
            router, experts = getattr(b.module, b.fam.router), getattr(b.module, b.fam.experts)
            gate_w = router.weight
            H = gate_w.shape[-1]
            I = experts.down_proj.shape[-1]
            want = {
                "router.weight": (gate_w.shape, (b.E, H)),
                "experts.gate_up_proj": (experts.gate_up_proj.shape, (b.E, 2 * I, H)),
                "experts.down_proj": (experts.down_proj.shape, (b.E, H, I)),
            }
            problems += [
                where + f"{n} has shape {tuple(got)}, expected {exp} (num_experts={b.E})"
                for n, (got, exp) in want.items()
                if tuple(got) != exp
            ]
        if b.E % ep:
            problems.append(where + f"num_experts {b.E} is not divisible by ep_size {ep}")
        if not 1 <= b.k <= b.E:
            problems.append(where + f"top_k {b.k} must be in [1, num_experts {b.E}]")
    return problems


def _block_tensors(b: MoEBlock | HFExperts) -> list[torch.Tensor]:
    if isinstance(b, HFExperts):
        return list(b.block.parameters())
    if b.fam is None:
        return [b.module.gate.weight, *b.module.experts.parameters()]
    return [getattr(b.module, b.fam.router).weight, *getattr(b.module, b.fam.experts).parameters()]


@torch.no_grad()
def _check_same_weights(blocks: list[MoEBlock | HFExperts], group) -> None:
    """Routers and the FULL expert weights must be equal on every rank of `group` (one all-gather)."""
    if group is None or group_size(group) == 1 or not blocks:
        return
    rows, spans = [], []
    for b in blocks:
        ts = _block_tensors(b)
        spans.append((len(rows), len(rows) + 2 * len(ts)))
        for t in ts:
            rows += [t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)]
    local = torch.stack(rows)[None]  # (1, 2 * tensors), on the params' device
    every = all_gather(local, dim=0, group=group)  # (G, 2 * tensors)
    for b, (lo, hi) in zip(blocks, spans):
        cols = every[:, lo:hi]
        if not torch.equal(cols, cols[:1].expand_as(cols)):
            raise ParallelError(
                "apply_expert_parallel",
                [
                    Problem(
                        f"{b.path} router / expert weights differ across the ranks of the data-parallel group",
                        "load the same full weights (same seed / checkpoint) on every rank before "
                        "apply_expert_parallel",
                    )
                ],
            )


def _hf_path(model, cfg, blocks: list[MoEBlock], problems: list[str]) -> tuple[list[HFExperts], list[str]]:
    """Where hfpar's MoELayer does not fit (a router it does not reproduce, biases, another expert layout), the HF
    block's own code with only its experts sharded (hf_experts.py): (experts modules, problems) or ([], [])."""
    if not problems or any(b.fam is None for b in blocks) or getattr(cfg, "model_type", None) in MOE_FAMILIES:
        return [], []
    return find_hf_experts(model)


def _validate_hf(found: list[HFExperts], ep: int, aux_loss_coef, z_loss_coef, capacity_factor) -> list[str | Problem]:
    problems = [f"{x.path}: num_experts {x.E} is not divisible by ep_size {ep}" for x in found if x.E % ep]
    problems += [
        f"{x.path}: its {x.zero} experts without weights (routed indices {x.E}..{x.E + x.zero - 1}) keep rows in "
        f"{', '.join(n for n, p in x.module.named_parameters() if p.shape[0] == x.E + x.zero)}, which split over the "
        f"ep ranks: {x.zero} is not divisible by ep_size {ep}"
        for x in found
        if x.zero % ep
    ]
    asked = {
        k: v
        for k, v in (
            ("aux_loss_coef", aux_loss_coef),
            ("z_loss_coef", z_loss_coef),
            ("capacity_factor", capacity_factor),
        )
        if v
    }
    if found and asked:
        x = found[0]
        problems.append(
            Problem(
                f"{x.path} ({type(x.block).__name__}) keeps the HF block's own router, so "
                f"{', '.join(f'{k}={v}' for k, v in asked.items())} (hfpar's router) cannot apply",
                "pass None (the HF model's own aux loss comes with output_router_logits)",
            )
        )
    return problems


def _param_like(src: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(src.detach().clone(), requires_grad=src.requires_grad)


def _new_router(weight: torch.Tensor, num_experts: int, top_k: int, **kw) -> TopKRouter:
    """A TopKRouter whose (E, H) weight is `weight` (its dtype / device), built without an init pass."""
    with torch.device("meta"):
        router = TopKRouter(weight.shape[-1], num_experts, top_k, **kw)
    router.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
    router.last_aux_loss, router.last_z_loss = torch.zeros(()), torch.zeros(())
    router.last_load = torch.zeros(num_experts)
    return router


def _convert(
    b: MoEBlock,
    cfg,
    *,
    ep: int,
    ep_rank: int,
    ep_group,
    dp_group,
    aux_loss_coef,
    z_loss_coef,
    capacity_factor,
    share: bool = False,
) -> MoELayer:
    """The MoELayer of block b holding experts [ep_rank * E/ep, ...). share (ep 1): reuse b's tensors (probe)."""
    El, start = b.E // ep, ep_rank * (b.E // ep)
    take = (lambda t: t) if share else (lambda t: _param_like(t[start : start + El]))
    if b.fam is None:  # upcycled MoELayer with all experts
        router, src = b.module.gate, b.module.experts
        shared, shared_gate = b.module.shared_expert, b.module.shared_expert_gate
        act = src.act_name
    else:  # HF block: HF's objective, no aux
        fam = b.fam  # unless asked (aux_loss_coef)
        hf_router, src = getattr(b.module, fam.router), getattr(b.module, fam.experts)
        router = _new_router(
            hf_router.weight if share else _param_like(hf_router.weight),
            b.E,
            b.k,
            norm_topk_prob=bool(config_value(cfg, fam.norm_topk_prob)),
            jitter_eps=float(getattr(cfg, fam.jitter, 0.0) or 0.0) if fam.jitter else 0.0,
            aux_loss_coef=0.0,
        )
        shared = getattr(b.module, fam.shared_expert) if fam.shared_expert else None
        shared_gate = getattr(b.module, fam.shared_expert_gate) if fam.shared_expert_gate else None
        act = getattr(cfg, "hidden_act", "silu")
    router.group = dp_group
    if aux_loss_coef is not None:
        router.aux_loss_coef = float(aux_loss_coef)
    if z_loss_coef is not None:
        router.z_loss_coef = float(z_loss_coef)
    H, I = src.gate_up_proj.shape[-1], src.down_proj.shape[-1]
    with torch.device("meta"):
        experts = GroupedExperts(El, H, I, act)
    experts.gate_up_proj = take(src.gate_up_proj)  # (E/ep, 2I, H)
    experts.down_proj = take(src.down_proj)  # (E/ep, H, I)
    names = (
        {} if b.fam is None else {"router_name": b.fam.router, "shared_name": b.fam.shared_expert or "shared_expert"}
    )
    return MoELayer(
        router,
        experts,
        ep_group=ep_group,
        shared_expert=shared,
        shared_expert_gate=shared_gate,
        capacity_factor=capacity_factor,
        **names,
    )


@torch.no_grad()
def _probe(cfg, block: nn.Module, fam: MoEFamily, E: int, k: int) -> float:
    """Relative difference between a generic HF block and its hfpar MoELayer (same tensors) on random tokens."""
    layer = _convert(
        MoEBlock("", block, fam, E, k),
        cfg,
        ep=1,
        ep_rank=0,
        ep_group=None,
        dp_group=None,
        aux_loss_coef=None,
        z_loss_coef=None,
        capacity_factor=None,
        share=True,
    )
    w = layer.experts.gate_up_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, layer.gate.hidden_size, generator=g).to(device=w.device, dtype=w.dtype)  # (B, T, H)
    training = block.training
    block.eval()
    try:
        want = block(x.clone())
    finally:
        block.train(training)
    want = want[0] if isinstance(want, tuple) else want
    got = layer.eval()(x.clone(), token_mask=torch.ones(x.shape[:2], device=x.device))
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def apply_expert_parallel(
    model: nn.Module,
    ep_group=None,
    *,
    dp_group=None,
    edp_group=None,
    aux_loss_coef: float | None = None,
    z_loss_coef: float | None = None,
    capacity_factor: float | None = None,
    check_replicated: bool = True,
) -> nn.Module:
    """Replace every sparse MoE block (MOE_FAMILIES, generic blocks, or MoELayers made by upcycle_to_moe) by
    an expert-parallel MoELayer holding this rank's E/ep experts; returns `model` (changed in place).

    ep_group: a process group (None = the default group; no EP when torch.distributed is not initialised),
    or a hfpar ParallelContext, whose ep / replica (dp x cp) / expert-dp groups are then used (its
    `expert_groups`): under context parallelism each cp rank routes the tokens of its part of the sequence,
    the routers' statistics span dp x cp (every token), and expert grads are divided by dp x cp.
    dp_group must contain ep_group; routers compute aux / z / capacity statistics over it.
    edp_group: the ranks holding the same experts (expert_parallel_groups); recorded in each expert
    parameter's ShardSpec (dp_reduce_group, dp_size) for the data-parallel grad reduction.
    aux_loss_coef: None = the HF model's objective (aux loss only with output_router_logits, computed by the
    model; upcycled layers keep their coefficient); a number = hfpar's global aux loss with that coefficient,
    injected in backward (module docstring). z_loss_coef: None = keep (HF blocks: 0); capacity_factor: None =
    dropless. Every problem is collected and raised as one ParallelError (a ValueError) before any collective; then
    (check_replicated) one all-gather over dp_group checks that every rank loaded the same router / expert
    weights. Every rank of dp_group must then run every MoE forward (their statistics are all-reduced).
    """
    if ep_group is None:
        refuse_unlaunched("apply_expert_parallel")  # torchrun without a process group
    initialised = dist.is_available() and dist.is_initialized()
    if hasattr(ep_group, "expert_groups"):  # a ParallelContext: EP from dp x cp
        ep_group, dp_group, edp_group = ep_group.expert_groups
    ep_group = ep_group if ep_group is not None else _default_group()
    dp_group = dp_group if dp_group is not None else _default_group()
    ep, dp = group_size(ep_group), group_size(dp_group)  # None: the default group's size
    cfg = getattr(model, "config", None)
    blocks, problems = find_moe_blocks(model, lambda *a: _probe(cfg, *a))
    hf, hf_problems = _hf_path(model, cfg, blocks, problems)
    if hf or hf_problems:  # the HF blocks' own code, experts sharded
        blocks, problems = [], hf_problems
    problems += _validate(blocks, ep, dp) + _validate_hf(hf, ep, aux_loss_coef, z_loss_coef, capacity_factor)
    if not problems and initialised and ep > 1 and ep_group is not dp_group:
        ep_ranks, dp_ranks = _ranks(ep_group), _ranks(dp_group)
        if not set(ep_ranks) <= set(dp_ranks):
            problems.append(f"the EP group (ranks {ep_ranks}) is not inside the data-parallel group (ranks {dp_ranks})")
    if problems:
        raise ParallelError("apply_expert_parallel", problems)
    if check_replicated:
        _check_same_weights([*blocks, *hf], dp_group)
    text = text_config(cfg)  # a multimodal wrapper: its language model's sizes
    if hf and ep == 1:  # ep 1: HF blocks, plain experts on hfpar's
        speed_up_hf_experts(hf, hidden_size=int(text.hidden_size), vocab_size=getattr(text, "vocab_size", None))
    if hf and ep > 1:
        try:
            shard_hf_experts(
                hf, ep_group, hidden_size=int(text.hidden_size), vocab_size=getattr(text, "vocab_size", None)
            )
        except ValueError as exc:  # a failed equality check: nothing sharded
            raise ParallelError("apply_expert_parallel", [str(exc)]) from None
        for x in hf:
            for p in x.module.parameters():
                set_shard_spec(p, dp_reduce_group=edp_group, dp_size=dp)

    ep_rank = group_rank(ep_group) if ep > 1 else 0
    for b in blocks:
        layer = _convert(
            b,
            cfg,
            ep=ep,
            ep_rank=ep_rank,
            ep_group=ep_group if initialised else None,
            dp_group=dp_group if initialised else None,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            capacity_factor=capacity_factor,
        )
        layer.parallelized = True
        for p in layer.experts.parameters():
            if shard_spec(p) is not None:  # ep > 1: sharded over the EP group
                set_shard_spec(p, dp_reduce_group=edp_group, dp_size=dp)
        # output_router_logits: the model's own aux loss; a value only where hfpar injects one
        record_router_logits(layer, detach=layer.gate.aux_loss_coef != 0)
        parent, _, name = b.path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layer)
    if aux_loss_coef is not None and getattr(cfg, "output_router_logits", False):
        cfg.output_router_logits = False  # hfpar's global aux loss replaces HF's
    if ep > 1:
        mark_parallel(model, f"expert-parallel over {ep} ranks")  # stock DDP / fully_shard refuse it
    return model
