"""Apply tensor parallelism (and sequence parallelism) to a loaded HF causal LM, in place.

    # torchrun --nproc_per_node 2 -m hfpar.parallel.tensor_parallel.apply     (runs this example, checked)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)          # the SAME full weights on every rank
    apply_tensor_parallel(model, tp_group, sequence_parallel=True)
    out = model(input_ids, attention_mask=mask, labels=labels)   # HF's loss API (hf_loss.py), same math
    out.logits                                             # (B, T, V/tp): this rank's vocab slice
    loss = vocab_parallel_cross_entropy(out.logits[:, :-1], labels[:, 1:], group=tp_group)   # == out.loss
    loss.backward()
    # replicated params that see part of the heads / tokens (q/k norms, SP norms): summed by apply's own hooks
    clip_tp_grad_norm_(model.parameters(), 1.0)            # counts every shard once (hfpar.parallel.sharding)
    model.save_pretrained(out, state_dict=gather_full_state_dict(model))   # collective; a normal checkpoint

Layout of one decoder layer at tp ranks (per-architecture plans in plans.py):

    x (B, T, H) replicated       [SP: (B, T/tp, H), split along T once, on entry to the first layer]
    input_layernorm              replicated weight            [SP: on T/tp tokens; grad summed over TP]
    self_attn   enter region     bwd all-reduce               [SP: fwd all-gather T, bwd reduce-scatter]
      q/k/v_proj  column         (B, T, heads/tp * head_dim)  local heads; attention on local heads
      o_proj      row            fwd all-reduce               [SP: fwd reduce-scatter T, bwd all-gather]
    mlp: the same with gate/up (column) and down (row)
    final norm, lm_head column   logits (B, T, V/tp), gathered only by generate() [SP: lm_head all-gathers T]

Plans: plans.py (written: Llama family, Phi-3, Gemma, BERT, GPT-2 with Conv1D layers), else derived from the
config's base_model_tp_plan (derived.py; TP only).

The attention / MLP modules enter the TP region themselves, not each column layer
(why: docs/architecture.md#why-the-parallel-layers).

The embedding is NOT sequence-sharded: LlamaModel derives cache_position, default position_ids and
the causal mask from inputs_embeds.shape[1]; they (and rotary cos/sin) stay full length, which is
what attention needs after its all-gather.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_reduce, group_rank, group_size
from ..errors import ParallelError
from ..guard import mark_parallel, refuse_unlaunched
from ..language_model import language_model_path, text_config
from ..sharding import partial_grad_hooks
from .block_check import verify_first_block
from .derived import derive_plan

# re-exported: the gradient and export names lived here before grads.py
from .grads import (  # noqa: F401
    clip_tp_grad_norm_,
    gather_full_state_dict,
    sequence_parallel_grad_hooks,
    sync_sequence_parallel_grads,
    tp_grad_norm,
)
from .hf_loss import install_hf_semantics
from .infer import infer_plans, unrecognised
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .plans import TESTED_DERIVED_MODEL_TYPES, TP_PLANS, compile_pattern, get_plan, reroot_plan, validate_plan
from .sequence_plan import sequence_parallel_plan
from .shape_check import REGIONS as _REGIONS
from .shape_check import drop_empty_regions, match_plan, moe_block_names, validate_degrees
from .shard_modules import RegionColumnParallelLinear, shard_modules
from .tiny_check import on_meta, verify_on_tiny_copy

__all__ = [
    "apply_tensor_parallel",
    "sync_sequence_parallel_grads",
    "tp_grad_norm",
    "clip_tp_grad_norm_",
    "gather_full_state_dict",
    "RegionColumnParallelLinear",
]


def _check_replicated(model: nn.Module, group) -> None:
    """Cheap check that every rank holds the same full weights: (sum, L2 norm) per parameter,
    compared by a MAX and a MIN all-reduce (two small collectives, no full-size copies)."""
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    if not named:
        return
    stats = torch.stack(
        [
            torch.stack(
                [p.detach().sum(dtype=torch.float64), torch.linalg.vector_norm(p.detach(), dtype=torch.float64)]
            ).to(named[0][1].device)
            for _, p in named
        ]
    )  # (P, 2)
    hi = all_reduce(stats, group, op=dist.ReduceOp.MAX)
    lo = -all_reduce(-stats, group, op=dist.ReduceOp.MAX)
    bad = (~torch.isclose(hi, lo, rtol=1e-9, atol=0.0, equal_nan=True)).any(dim=1).tolist()
    names = [n for (n, _), b in zip(named, bad) if b]
    if names:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"the full weights differ across the ranks of the TP group "
                f"(every rank must load the same model: same checkpoint, or the same seed before "
                f"from_config): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            ],
        )


def apply_tensor_parallel(
    model: nn.Module,
    tp_group=None,
    *,
    sequence_parallel: bool = False,
    plan: Mapping[str, str] | None = None,
    verify_weights: bool = True,
    verify_plan: bool = True,
) -> nn.Module:
    """Shard an HF causal LM over `tp_group` (a process group, None = the default group, or a
    hfpar ParallelContext: its tp group), in place; returns it.

    Every rank must hold the SAME full weights on entry (same checkpoint, or the same seed before
    from_config); each keeps only its shard. verify_weights checks that with two small all-reduces.
    All degrees are validated before the first collective. The model's logits become vocab shards
    (B, T, V/tp) (the LM head's weight has a "tp" ShardSpec); `model(..., labels=).loss` is computed from them
    by vocab_parallel_cross_entropy (installed as model.loss_function), generate() gathers them
    (gather_vocab_logits does it for your own code). No written plan for the model type: one is derived
    from config.base_model_tp_plan (derived.py), or inferred from the modules when the config has none (infer.py),
    or refused in one line. Every plan is verified on a copy of the first decoder block (block_check.py; verify_plan).
    sequence_parallel=True: activations between TP regions are (B, T/tp, H); T must be divisible by tp.
    Replicated parameters whose gradient covers this rank's heads or tokens only (q/k norms on local heads, norms
    under SP) get a backward hook summing it over the TP group: a plain loop needs no extra call.
    The shared model.config keeps the full sizes (for export); attention modules see per-rank heads.
    """
    tp_group = getattr(tp_group, "tp_group", tp_group)  # a ParallelContext, or the group itself
    if tp_group is None:
        refuse_unlaunched("apply_tensor_parallel")  # under torchrun without a process group: a world of one
    if tp_group is None and dist.is_available() and dist.is_initialized():
        tp_group = dist.group.WORLD  # named: ShardSpecs with group None are skipped by export and grad norm
    tp = group_size(tp_group)
    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) for m in model.modules()):
        raise ParallelError("apply_tensor_parallel", ["the model is already tensor-parallel"])
    if hasattr(model, "peft_config") or any(hasattr(m, "lora_A") for m in model.modules()):
        raise ParallelError(  # PEFT's layers hide the Linears the plans name, and their adapters would stay whole
            "apply_tensor_parallel",
            [
                "the model has PEFT adapters; apply tensor parallelism first, then LoRA: "
                "hfpar.parallel.tensor_parallel.lora.get_tp_peft_model (docs/lora.md)"
            ],
        )
    if tp == 1:  # nothing to shard; logits stay full
        return model
    # a multimodal wrapper (Gemma-3, LLaVA, Fuyu, ...) is sized and planned by its language model: heads, layers,
    # vocabulary and model_type from the text config; the towers beside it stay replicated (language_model.py)
    config = text_config(getattr(model, "config", None))
    lm_path = language_model_path(model)
    moe = moe_block_names(model)
    if moe and sequence_parallel:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"sequence_parallel with MoE blocks ({moe[0]}, ...): the experts stay "
                "whole on every TP rank and route the full sequence; use TP without sequence_parallel"
            ],
        )
    optional: tuple[str, ...] = ()
    derived = plan is None and config is not None and getattr(config, "model_type", None) not in TP_PLANS
    if plan is None:
        if config is None or not getattr(config, "model_type", None):
            raise ParallelError("apply_tensor_parallel", ["the model has no config.model_type; pass plan="])
        if config.model_type in TP_PLANS:
            plan = get_plan(config.model_type)
            if lm_path:  # the text family's written plan, moved under the wrapper's language model
                head = model.get_output_embeddings()
                names = {id(m): n for n, m in model.named_modules()}
                plan = reroot_plan(plan, config.model_type, lm_path, names.get(id(head)))
        elif not getattr(config, "base_model_tp_plan", None) or not _shards_blocks(
            model, derived_plan := derive_plan(model)
        ):
            # inferred from the modules, verified (infer.py); also when HF's plan shards nothing hfpar's TP does in
            # the decoder blocks (HunYuan-MoE's names only its routed experts, which expert parallelism splits)
            try:
                plan = _infer(model, config, tp, tp_group, sequence_parallel, verify_weights)
                verify_weights = verify_plan = False  # both done by _infer for the plan it returns
            except ValueError:
                if sequence_parallel or not getattr(config, "base_model_tp_plan", None):
                    raise
                plan = derived_plan  # HF's own: embedding and LM head sharded, the blocks replicated (exact)
        else:  # from the config's base_model_tp_plan; one-line refusal naming the entry hfpar cannot map
            plan = derived_plan
            if config.model_type not in TESTED_DERIVED_MODEL_TYPES:
                warnings.warn(
                    f"apply_tensor_parallel: model_type {config.model_type!r} is sharded by a plan derived "
                    "from its base_model_tp_plan that hfpar has not parity-tested; compare its loss with "
                    "the unsharded model's once",
                    stacklevel=2,
                )
            if sequence_parallel:  # the entries a written plan names by hand, from the structure (verified)
                plan = sequence_parallel_plan(model, plan)
        optional = ("colwise_lm_head",)
    validate_plan(plan)
    # with MoE blocks a plan names layer kinds the model may not have (the dense MLPs of an all-MoE model)
    # derived plans list every variant a family has (DeepSeek's q_proj or q_a/q_b_proj): the absent ones are skipped
    matched = match_plan(model, plan, optional, allow_unmatched=bool(moe) or derived)
    if derived:
        matched = drop_empty_regions(matched)
    assigned = {n: s for n, (s, _) in matched.items()}
    lm_head = any(s == "colwise_lm_head" for s in assigned.values())
    if sequence_parallel and not lm_head:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"sequence_parallel needs a vocab-parallel LM head to gather the "
                f"sequence back (causal LMs); {type(model).__name__} has none: use TP without "
                "--sequence_parallel"
            ],
        )
    unpadded = getattr(config, "unpadded_vocab_size", None)
    if lm_head and isinstance(unpadded, int) and unpadded < model.get_output_embeddings().out_features:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"config.unpadded_vocab_size {unpadded} (the forward slices the "
                "logits to it) with a vocab-parallel LM head; pass a plan without 'colwise_lm_head'"
            ],
        )
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inp is not None and out is not None and out.weight is inp.weight
    validate_degrees(model, matched, config, tp, sequence_parallel, tied)
    # ---- collectives from here on
    if verify_weights:
        _check_replicated(model, tp_group)

    shard = partial(shard_modules, config=config, tp=tp, tp_group=tp_group, sequence_parallel=sequence_parallel)
    while verify_plan:
        try:
            model._hfpar_tp_verify_rel = _verify(
                model, plan, assigned, shard, tp_group, sequence_parallel, optional, derived
            )
            break
        except ParallelError as e:  # a derived plan: the region that differs kept whole, the rest verified again
            region = _failing_region(plan, getattr(e, "module", None)) if derived and not sequence_parallel else None
            if region is None:
                raise
            plan = {p: s for p, s in plan.items() if p != region and not p.startswith(region + ".")}
            why = e.reasons.split("; the model is left")[0]
            warnings.warn(
                f"apply_tensor_parallel: {region} is kept whole on every TP rank: sharded by the plan derived from "
                f"base_model_tp_plan it does not reproduce the unsharded model ({why})",
                stacklevel=2,
            )
            matched = drop_empty_regions(match_plan(model, plan, optional, allow_unmatched=True))
            assigned = {n: s for n, (s, _) in matched.items()}
            validate_degrees(model, matched, config, tp, sequence_parallel, tied)
    new_modules = shard(model, assigned)
    if tied:  # the lm_head keeps sharing the embedding's Parameter: same rows, same vocab split
        emb = next(new_modules[n] for n, s in assigned.items() if s == "vocab_embedding")
        head = next(new_modules[n] for n, s in assigned.items() if s == "colwise_lm_head")
        head.weight = emb.weight
    # replicated parameters whose grad covers this rank's heads / tokens only: summed over TP inside backward, so a
    # plain loop is exact (sync_sequence_parallel_grads then skips them: one reduction, never two)
    partial_grad_hooks(model.parameters())
    # model(**batch, labels=...).loss through the vocab-parallel cross-entropy, generate(), guards (hf_loss.py)
    install_hf_semantics(model, tp_group, sequence_parallel=sequence_parallel, vocab_parallel_head=lm_head)
    mark_parallel(model, f"tensor-parallel over {tp} ranks")  # stock DDP / fully_shard refuse it (guard.py)
    return model


def _verify(
    model: nn.Module, plan, assigned, shard, tp_group, sequence_parallel: bool, optional, derived, probe_meta=False
) -> float:
    """The plan verified: on a tiny copy of a meta skeleton (tiny_check.py; no weights yet: the sharded loading),
    else on copies of the model's own blocks (block_check.py). probe_meta (an inferred plan): where a skeleton has
    no tiny copy, its first block with random weights at full size instead of the warning."""
    if on_meta(model):
        kw = {"optional": optional, "drop_empty": derived, "sequence_parallel": sequence_parallel}
        rel = verify_on_tiny_copy(model, plan, tp_group, warn=not probe_meta, **kw)
        if rel is not None:
            return rel
    mt = getattr(text_config(getattr(model, "config", None)), "model_type", None)
    return verify_first_block(
        model, assigned, shard, tp_group, sequence_parallel=sequence_parallel, model_type=mt, probe_meta=probe_meta
    )


def _failing_region(plan: Mapping[str, str], module: str | None) -> str | None:
    """The plan's region pattern (attention / mlp) holding `module`, the one a failed verification named."""
    parts = (module or "").split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    for pattern, style in plan.items():
        if style.partition(":")[0] in _REGIONS and any(compile_pattern(pattern).fullmatch(p) for p in prefixes):
            return pattern
    return None


def _infer(model: nn.Module, config, tp: int, tp_group, sequence_parallel: bool, verify_weights: bool) -> dict:
    """The first plan of infer_plans(model) that validates and passes verify_first_block; one-line refusal else."""
    mt = config.model_type
    candidates = infer_plans(model)
    if not candidates:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"model_type {mt!r} has no hfpar plan and no usable "
                f"base_model_tp_plan, and {unrecognised(model)}; pass plan={{module pattern: style}}"
            ],
        )
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = inp is not None and out is not None and out.weight is inp.weight
    last: ValueError | None = None
    checked = False
    for plan in candidates:
        try:
            if sequence_parallel:
                plan = sequence_parallel_plan(model, plan)
            matched = drop_empty_regions(match_plan(model, plan, ("colwise_lm_head",), allow_unmatched=True))
            validate_degrees(model, matched, config, tp, sequence_parallel, tied)
        except ValueError as e:
            last = e
            continue
        if verify_weights and not checked:
            _check_replicated(model, tp_group)
            checked = True
        shard = partial(shard_modules, config=config, tp=tp, tp_group=tp_group, sequence_parallel=sequence_parallel)
        try:  # a skeleton: on its tiny copy, else (custom code) its first block with random weights at full size
            assigned = {n: s for n, (s, _) in matched.items()}
            lm_head = ("colwise_lm_head",)
            model._hfpar_tp_verify_rel = _verify(
                model, plan, assigned, shard, tp_group, sequence_parallel, lm_head, True, probe_meta=True
            )
        except ValueError as e:
            last = e
            continue
        warnings.warn(
            f"apply_tensor_parallel: model_type {mt!r} is sharded by a plan inferred from its modules and "
            "verified on its first block",
            stacklevel=3,
        )
        return plan
    # the last refusal without the `apply_tensor_parallel: ` this message repeats (another `where` stays whole)
    why = last.detail if isinstance(last, ParallelError) and last.where == "apply_tensor_parallel" else str(last)
    raise ParallelError(
        "apply_tensor_parallel",
        [
            f"no sound tensor-parallel plan could be inferred for model_type {mt!r} ({len(candidates)} candidate(s); "
            "last: "
            f"{why})"
        ],
    )


def _shards_blocks(model: nn.Module, plan: Mapping[str, str]) -> bool:
    """Whether a derived plan shards a region of this model (HF's plan may name only layer kinds it lacks: Inkling's
    dense MLPs, every layer of the tiny model being MoE)."""
    matched = drop_empty_regions(match_plan(model, plan, ("colwise_lm_head",), allow_unmatched=True))
    return any(s.partition(":")[0] in _REGIONS for s, _ in matched.values())


def _demo(rank: int, world_size: int) -> None:
    """The docstring's example on a tiny Llama, checked against the unsharded model."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM  # the demo only: the layer library needs no transformers

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 8))
    apply_tensor_parallel(model, sequence_parallel=True)
    loss = vocab_parallel_cross_entropy(model(ids).logits[:, :-1], ids[:, 1:])
    ref_loss = F.cross_entropy(ref(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(loss, ref_loss, atol=1e-5), (loss, ref_loss)
    assert torch.allclose(model(ids, labels=ids).loss, ref_loss, atol=1e-5)
    if rank == 0:
        print(
            f"ok: loss {loss.item():.6f} == {ref_loss.item():.6f}, rank {group_rank()} lm_head",
            tuple(model.lm_head.weight.shape),
        )


if __name__ == "__main__":
    dist.init_process_group("gloo")
    _demo(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
