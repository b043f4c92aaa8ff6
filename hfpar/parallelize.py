"""Parallelism applied to a loaded HF model by plain functions, in a fixed order, before the data-parallel wrap:

    model, info = parallelize(model, args, ctx, plan)   # plan: the preflight's RunPlan (hfpar.context)
        the strategy's adjustment (ctx.strategy.adjust_model) -> Liger's kernels (--use_liger_kernel) -> LoRA (PEFT
        adapters) -> MoE: upcycle + expert parallel -> tensor parallel (MoE blocks left whole) -> context-parallel
        attention -> fp8 Linear layers (mixed_precision fp8) -> chunked loss -> activation checkpointing -> regional
        compile (--torch_compile) -> pipeline stage
    backend.prepare(model)      the data-parallel wrap (DDP / FSDP2 / ZeRO, over ctx's dp group)

Every degree comes from the ParallelContext; each step is a no-op when its degree is 1. Raises ValueError
(one line per problem) for what only the loaded model reveals.
"""

from __future__ import annotations

import torch.distributed as dist

from hfpar.loading.lora import apply_lora, is_peft_model, lora_targets, trainable_summary
from hfpar.loading.lora_targets import adapters_in_moe_blocks, ep_lora_refusal
from hfpar.loading.sharded import is_meta
from hfpar.parallel.chunked_loss import chunkable, install_chunked_loss
from hfpar.parallel.context_parallel import enable_cp_attention
from hfpar.parallel.errors import ParallelError
from hfpar.parallel.expert_parallel import (
    apply_expert_parallel,
    attach_moe_token_mask,
    has_moe_blocks,
    inside,
    moe_replaced_paths,
    set_aux_loss_grad_scale,
    upcycle_to_moe,
)
from hfpar.parallel.pipeline import (
    PipelineChunks,
    PipelineStage,
    balanced_split,
    chunk_layers,
    decoder_layers,
    parse_split,
)
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from hfpar.precision.fp8 import convert_model
from hfpar.train.compile import compile_blocks, repeated_blocks
from hfpar.train.liger import apply_liger


def is_moe(model) -> bool:
    return has_moe_blocks(model)  # the library's detection (hfpar.parallel.expert_parallel), no family table


def lora_in_moe_blocks(model, replaced: list[str]) -> list[str]:
    """Paths (in the model PEFT wraps) of LoRA layers that hfpar's MoE conversion would bypass: inside the modules it
    takes over (replaced: moe_replaced_paths of the model before LoRA; a router, the experts) or on expert weights
    (PEFT's ParamWrapper, on 3-D tensors)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [
        path
        for path, m in base.named_modules()
        if hasattr(m, "lora_A")
        and hasattr(m, "base_layer")
        and (type(m).__name__ == "ParamWrapper" or inside(path, replaced))
    ]


def apply_moe(
    model, args, ctx, microbatches: int = 1, moe_replaced: list[str] | None = None, lora_at: list[str] | None = None
) -> str | None:
    """Upcycle (--upcycle_experts) and make MoE layers expert-parallel over ctx's EP groups. Any MoE model gets
    router statistics over all data-parallel ranks, so EP and DP do not change the aux loss; padding takes no
    part in routing statistics; the aux-loss gradient is scaled for hfpar's loss normalization (microbatches: the
    pipeline's per accumulation step, RunPlan.microbatches). Without
    --ep_size, blocks hfpar cannot convert stay the HF model's own: returns that one-line note (else None).
    moe_replaced: moe_replaced_paths of the model before LoRA wrapped it (None: of `model` as it is). lora_at: the
    adapters that will sit in those modules when LoRA comes after (tensor parallelism: lora_targets'
    adapters_in_moe_blocks on the unsplit model); None: those `model` holds now."""
    if args.upcycle_experts:
        upcycle_to_moe(
            model,
            args.upcycle_experts,
            args.moe_top_k,
            aux_loss_coef=args.moe_aux_loss_coef,
            z_loss_coef=args.moe_z_loss_coef,
            seed=args.seed,
        )
    if not is_moe(model):
        if ctx.ep > 1:
            raise ValueError(
                f"--ep_size {ctx.ep}: {type(model).__name__} has no MoE layers; "
                "pass --upcycle_experts N to turn its MLPs into experts first"
            )
        return
    # the HF model's objective: a native MoE model trains with its aux loss only when its config asks for it
    # (output_router_logits), then through hfpar's injection (the trainer's loss comes from the logits); upcycled
    # layers keep --moe_aux_loss_coef (None: keep)
    cfg = model.config
    coef = (
        None
        if args.upcycle_experts
        else (
            float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
            if getattr(cfg, "output_router_logits", False)
            else 0.0
        )
    )
    if lora_at is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        lora_at = lora_in_moe_blocks(model, moe_replaced if moe_replaced is not None else moe_replaced_paths(base))
    if lora_at:  # hfpar's MoE layers would compute past PEFT's adapters
        if ctx.ep > 1:  # expert parallelism needs hfpar's MoE layers, which would bypass these adapters
            raise ValueError(ep_lora_refusal(ctx.ep, lora_at[0]))
        if coef:
            raise ValueError(
                f"--use_peft with output_router_logits (router_aux_loss_coef {coef}): LoRA adapters sit in the MoE "
                f"blocks ({lora_at[0]}), which then train as the HF model's own, without hfpar's aux-loss path; "
                "set output_router_logits false in the model config, or name --lora_target_modules outside them"
            )
        return f"MoE blocks train as the HF model's own (LoRA adapters in them: {lora_at[0]}, ...)"
    # one process: the same hfpar MoE layers (and aux-loss injection) as distributed runs; a meta skeleton
    # (hfpar.loading.sharded) has no weights to compare across ranks yet: each rank reads its own experts after this
    try:
        if dist.is_initialized():
            apply_expert_parallel(model, ctx, aux_loss_coef=coef, check_replicated=not is_meta(model))
        else:
            apply_expert_parallel(model, aux_loss_coef=coef)
    except ParallelError as exc:
        # no EP asked: nothing needs converting, the HF blocks train as they are; but an aux loss asked for
        # (output_router_logits) reaches the recipes' loss (computed from the logits) only through hfpar's router
        if args.upcycle_experts:
            raise
        if coef:  # the refusal's reasons, with this advice in place of its own hints (pass None: not a recipe option)
            raise ValueError(
                f"output_router_logits with router_aux_loss_coef {coef}: the recipes add the aux loss "
                f"through hfpar's MoE router only, and {exc.reasons}; set "
                f"output_router_logits false in the model config (no aux loss)"
            ) from None
        if ctx.ep > 1:
            raise
        return f"MoE blocks train as the HF model's own ({exc.detail})"
    # the injected aux-loss gradient skips Accelerate's 1/accum and is averaged over dp by the backend like
    # every replicated grad: scale so the objective is main + coef * mean_m(aux_m), m over the micro-steps (x the
    # pipeline's micro-batches, each routed on its own: Megatron-LM's per-micro-batch load balancing)
    set_aux_loss_grad_scale(ctx.grad_replicas / (args.gradient_accumulation_steps * max(microbatches, 1)))
    attach_moe_token_mask(model)
    return None


def chunk_loss(model, args, ctx):
    """The chunked LM head + cross-entropy (hfpar.parallel.chunked_loss), after TP (its head may be vocab-parallel) and
    before the data-parallel wrap; unset = where exact; returns the chunk (tokens, "auto") or 0 when off."""
    if args.loss_chunk_size == 0 or ctx.pp > 1:  # the pipeline's last stage computes its loss from logits
        return 0
    why = chunkable(model)
    if why is not None:
        if args.loss_chunk_size:
            raise ValueError(f"--loss_chunk_size {args.loss_chunk_size}: {why}; pass 0 or leave it unset")
        return 0
    install_chunked_loss(model, args.loss_chunk_size)
    return args.loss_chunk_size or "auto"


def enable_checkpointing(model) -> None:
    """HF activation checkpointing of every decoder layer (non-reentrant: works with frozen inputs, LoRA, FSDP2).
    transformers >= 5.24 names it activation_checkpointing_enable (gradient_checkpointing_enable warns there);
    earlier 5.x releases (e.g. the GPU machine's) have the old name only."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def parallelize(model, args, ctx, plan) -> tuple:
    """In place (LoRA wraps: the returned model is PEFT's); returns (model, run_info extras). plan: the RunPlan
    (hfpar.context: the task, the pipeline's stages and micro-batches)."""
    info, task = {}, plan.task
    if ctx.strategy is not None:  # e.g. FSDP2's wrap classes (hfpar.backends.strategies)
        ctx.strategy.adjust_model(model)
    if args.use_liger_kernel:  # the model's own modules get Liger's kernels, before any layer wraps them
        info["liger"] = apply_liger(model)
    # LoRA before MoE (upcycling refused with LoRA by the preflight), the stage split and the wrap; under TP right
    # after it, on the targets PEFT picks on the unsplit model (hfpar.parallel.tensor_parallel.lora). Either way a
    # MoE block holding adapters (a router, the experts) stays the HF model's own (apply_moe)
    tp_lora = lora_targets(model, args, task) if args.use_peft and ctx.tp > 1 else None
    lora_at = None  # adapters in what hfpar's MoE conversion computes (None: none planned; apply_moe looks)
    if tp_lora is not None:
        lora_at = adapters_in_moe_blocks(model, tp_lora) if task == "lm" else None
    elif args.use_peft:
        replaced = moe_replaced_paths(model) if task == "lm" else None  # before PEFT wraps the experts
        model = apply_lora(model, args, task)
        lora_at = lora_in_moe_blocks(model, replaced) if replaced is not None else None
    # MoE before TP, which leaves MoE blocks whole on every TP rank (EP splits them)
    if task == "lm" and (note := apply_moe(model, args, ctx, plan.microbatches, lora_at=lora_at)):
        info["moe_note"] = note
    if ctx.tp > 1:
        apply_tensor_parallel(model, ctx, sequence_parallel=args.sequence_parallel)
    if tp_lora is not None:
        model = apply_lora(model, args, task, tp_targets=tp_lora)
    if args.use_peft:
        info["peft"] = {"lora_r": args.lora_r, "lora_alpha": args.lora_alpha, **trainable_summary(model)}
    if ctx.cp > 1:  # every attention of the model through hfpar's (transformers' attention-function registry)
        enable_cp_attention(model)
    if plan.fp8 is not None:  # after TP (its layers' shards), before the data-parallel wrap (FSDP2's fp8 all-gather)
        info["fp8"] = convert_model(model, plan.fp8, repeated_blocks(model))
    if task == "lm":
        info["loss_chunk_size"] = chunk_loss(model, args, ctx)
    if args.gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    if args.torch_compile:  # each decoder block, in place, inside its parallel layers (before the stage split)
        info["torch_compile"] = compile_blocks(model, args.torch_compile_backend, args.torch_compile_mode)
    if ctx.pp > 1:  # last: this rank keeps its stage of the (otherwise fully prepared) model
        # LoRA: the stage trims PEFT's base model (its layers hold the adapters); the PEFT model names the export
        peft_model = model if is_peft_model(model) else None
        hf = model.get_base_model() if peft_model is not None else model
        n_layers, stages = len(decoder_layers(hf)), plan.pipeline_stages
        bounds = parse_split(args.pp_split, n_layers, stages) if args.pp_split else balanced_split(hf, stages)
        info.update(
            pp_schedule=args.pp_schedule,
            pp_microbatches=plan.microbatches,
            pp_stage_layers=[[a, b] for a, b in zip(bounds, bounds[1:])],
        )
        if (
            stages > ctx.pp
        ):  # interleaved: rank r holds virtual stages r, r + pp, ..; [[start, stop] per chunk] per rank
            model = PipelineChunks(hf, ctx.pp_rank, ctx.pp, bounds, peft_model=peft_model)
            info.update(pp_virtual_stages=stages // ctx.pp, pp_stage_layers=chunk_layers(bounds, ctx.pp))
        else:
            model = PipelineStage(hf, ctx.pp_rank, bounds, peft_model=peft_model)
    return model, info
