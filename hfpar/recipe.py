"""What every recipe does, in order: parse -> accelerator -> preflight -> groups -> data -> model -> parallelize
-> backend -> train -> export.

    from hfpar.recipe import main
    main("sft")        # or "clm", "classify", "dpo", a registered recipe's name, or a Recipe; reads sys.argv

What differs between recipes is their record (hfpar.recipes: task, defaults, options, data, checks, objective);
what the run derives from its options and model config is the preflight's RunPlan (hfpar.context, resolved by
hfpar.preflight.resolve_plan).

User mistakes (bad options, bad data, an output_dir that holds someone's checkpoints) end with a
one-line `hfpar: error: ...` per problem on stderr and exit code 2, before the model is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys

import torch
from accelerate.utils import set_seed
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
)
from transformers.integrations import deepspeed as hf_ds

from hfpar import data, loading, recipes
from hfpar.checkpoint.output_dir import claim_output_dir, overwrite_previous_run, release_output_dir
from hfpar.config import ConfigError, RecipeArgs, parse_args, to_dict
from hfpar.data.dropped import announce_data_loss
from hfpar.distributed import configure_deepspeed, setup_accelerator, swapped
from hfpar.loading.sources import check_sources
from hfpar.observe.refusal import fail as _fail
from hfpar.observe.refusal import guarded
from hfpar.preflight import preflight


def _is_collective_timeout(exc: BaseException) -> bool:
    """Whether exc is a collective that timed out: torch's DistBackendError by type, gloo's plain RuntimeError and
    the store's DistStoreError by their text. why: docs/architecture.md#why-spine-and-launch"""
    if isinstance(exc, torch.distributed.DistBackendError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _tear_down(accelerator) -> None:
    """Collective, at a run's end (the caller has dropped its references to the trainer, backend and model):
    Accelerate's references to the prepared engine, optimizer and scheduler dropped (DeepSpeed's engine destroyed
    by Accelerate's free_memory) and the garbage collected while the process group is alive, every rank past a
    barrier, then the group destroyed. Left to Python's exit, an engine's collective handles are freed while the
    interpreter tears down and a peer may have closed its connections: a rank that had trained and exported
    everything ended with SIGABRT once (CI, DPO under ZeRO-3, 2026-11-28), failing a finished run."""
    accelerator.free_memory()
    if torch.distributed.is_initialized():  # Accelerate's end_training destroys it already when trackers are on
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _without_zero3_init():
    """Build the embedded (tiny, random-init) model outside DeepSpeed's zero.Init, so its initial weights are
    the same under every strategy; real checkpoints still load partitioned (zero3_init_flag) via from_pretrained."""
    with swapped(hf_ds, "_hf_deepspeed_config_weak_ref", None):
        yield


def load_model(
    args: RecipeArgs, task: str, num_labels: int | None = None, ctx=None, config=None, image_text: bool = False
):
    """-> (model, load): load = {"mode": sharded | fsdp2 | full | embedded, "why": ..., "index": ...}. Modes
    sharded / fsdp2 return a meta skeleton that hfpar.loading.sharded fills with this rank's slices (after LoRA, TP / EP
    and the pipeline stage split, or during the FSDP2 wrap). image_text: a vision-language model
    (AutoModelForImageTextToText; plan.image_text)."""

    cls = AutoModelForCausalLM if task == "lm" else AutoModelForSequenceClassification
    cls = AutoModelForImageTextToText if image_text else cls
    model_kwargs = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.model_name_or_path in data.EMBEDDED_MODELS:
        # a copy of the preflight's (num_labels is set on it)
        config = (
            copy.deepcopy(config)
            if config is not None
            else AutoConfig.from_pretrained(data.embedded_model_path(args.model_name_or_path), trust_remote_code=False)
        )
        if num_labels is not None:
            config.num_labels = num_labels
        torch.manual_seed(args.seed)  # same init on every rank
        with _without_zero3_init():
            return cls.from_config(config, **model_kwargs), {"mode": "embedded", "why": "tiny random-init default"}
    kw = {"num_labels": num_labels} if num_labels is not None else {}
    load = {"mode": "full", "why": "no context (one process)"}
    if ctx is not None:
        config = (
            config
            if config is not None
            else AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        )
        mode, why = loading.loading_mode(args, ctx, config)
        path = loading.resolve_checkpoint(args.model_name_or_path) if mode != "full" else None
        index = loading.checkpoint_index(path)
        load = {
            "mode": mode if index else "full",
            "why": why if index or mode == "full" else "no *.safetensors or zip-format *.bin weights",
        }
    if load["mode"] == "full":
        # fp32 master weights; the accelerate config's mixed_precision decides the compute dtype.
        model = cls.from_pretrained(
            args.model_name_or_path, dtype=torch.float32, trust_remote_code=args.trust_remote_code, **kw, **model_kwargs
        )
        _keep_frozen(model, cls)
        if ctx is not None and ctx.strategy.partitions_at_load:  # zero.Init partitioned each parameter as it loaded
            load["partitioned_at_load"] = all(hasattr(p, "ds_id") for p in model.parameters())
    else:
        with _without_zero3_init():  # a meta skeleton: parameters come from the files, rank by rank
            model = loading.build_skeleton(
                cls, path, index, config_updates=kw, trust_remote_code=args.trust_remote_code, **model_kwargs
            )
        load["index"] = index
    if task == "classify" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model, load


def _keep_frozen(model, cls) -> None:
    """from_pretrained returns every parameter trainable, also those the model's own __init__ freezes (Ernie-4.5-MoE's
    moe_statics.e_score_correction_bias: a routing statistic no gradient reaches, whose missing grad DDP would wait
    for): the flags of a meta-device model of the same config are put back."""
    try:
        with _without_zero3_init(), torch.device("meta"):
            frozen = {n for n, p in cls.from_config(model.config).named_parameters() if not p.requires_grad}
    except Exception:  # noqa: BLE001 - a config from_config cannot build again: the loaded flags stay as they are
        return
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)


# a rank failing because a peer refused (and left) ends quietly: the refusal was said (hfpar/observe/refusal.py)
@guarded
def main(recipe: str | recipes.Recipe, argv: list[str] | None = None) -> dict:
    recipe = recipes.get(recipe) if isinstance(recipe, str) else recipe
    kind, task = recipe.name, recipe.task
    try:
        embedded = (*data.EMBEDDED_MODELS, recipe.defaults.get("model_name_or_path"))  # naming one: still the demo
        args = parse_args(
            argv,
            recipe=kind,
            defaults=recipe.defaults,
            args_class=recipe.args_class,
            demo=recipe.demo,
            embedded=embedded,
        )
        lock = claim_output_dir(args)  # one run per --output_dir; nothing there that hfpar did not write is touched
        check_sources(args)  # no code from a model dir without --trust_remote_code; bounded, parseable JSON
    except ConfigError as exc:
        _fail(str(exc))
    log_with = None if args.report_to == "none" else [t.strip() for t in args.report_to.split(",")]
    try:
        accelerator = setup_accelerator(args, log_with=log_with, project_dir=args.output_dir)
        # every problem (the recipe's own checks last), before any weight is read; plan: what the run derives
        ctx, backend_cls, plan = preflight(args, accelerator, task, recipe)
        # imported after the preflight: the parallel layers pull in transformers' attention / loss modules and
        # torch._dynamo (about 2 s measured with -X importtime), which a refusal must not pay
        from hfpar.checkpoint.checkpointer import PREEMPTED_EXIT, Preempted  # noqa: PLC0415  (the trainer's, as below)
        from hfpar.parallelize import parallelize  # noqa: PLC0415
        from hfpar.train.trainer import NonFiniteError, Trainer  # noqa: PLC0415

        gc.freeze()  # as recipes/sft.py: what these imports built is never garbage (Python's exit no longer walks it)
        configure_deepspeed(accelerator, args, ctx.grad_replicas)  # DeepSpeed's data-parallel world: dp x cp
        ctx.build_groups()
        set_seed(args.seed)
        tokenizer = data.load_tokenizer(args.tokenizer_path, trust_remote_code=args.trust_remote_code)
        if plan.padding_free_why_not:
            accelerator.print(f"[hfpar] padded batches (padding-free does not apply): {plan.padding_free_why_not}")
        with accelerator.main_process_first():
            built = recipe.build_data(args, tokenizer, ctx, plan)
            train_ds, eval_ds, collator, info, num_labels = built[:5]
        announce_data_loss(info, args, accelerator.print, len(train_ds), ctx.dp)  # what truncation left out: said
    except (ConfigError, data.DataError) as exc:
        _fail(str(exc))
    overwrite_previous_run(args, accelerator)  # after every refusal before the model loads: a refused run moves nothing
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()
    if log_with:
        accelerator.init_trackers(args.run_name or f"hfpar-{kind}", config=to_dict(args))
    strategy = ctx.strategy  # resolved once, by the preflight
    model, load = load_model(args, task, num_labels, ctx, plan.model_config, plan.image_text)
    try:
        model, extra = parallelize(model, args, ctx, plan)
        if extra.get("moe_note"):
            accelerator.print(f"[hfpar] {extra['moe_note']}")
        if load["mode"] == "sharded":  # TP / EP / stage split applied on the meta skeleton: this rank's slices
            load.update(loading.load_sharded(model, load["index"]))
    except ValueError as exc:  # what only the loaded model reveals (LoRA targets, plan mismatches, MoE shapes)
        _fail(str(exc))
    accelerator.print(f"[hfpar] model loading: {load['mode']} ({load['why']})")
    extra["loading"] = {k: v for k, v in load.items() if k != "index"}
    backend_kw = {"checkpoint_index": load["index"]} if load["mode"] == strategy.wrap_load else {}
    backend = backend_cls(accelerator, ctx, strategy, args, run_plan=plan, **backend_kw)
    try:
        objective = recipe.objective(args, ctx, plan, model, built)  # owns its reference model, if any
    except ValueError as exc:  # what only the loaded model reveals (e.g. a reference that cannot be built)
        _fail(str(exc))
    trainer = Trainer(
        args,
        accelerator,
        ctx,
        backend,
        model,
        built.processor or tokenizer,  # saved beside the model: a vision-language model's processor
        train_ds,
        eval_ds,
        collator,
        plan,
        objective,
        run_extra={
            "recipe": kind,
            "sequence_parallel": args.sequence_parallel,
            "padding_free": plan.padding_free,
            "one_row": plan.one_row,
            **({"cp_mode": plan.cp_mode} if ctx.cp > 1 else {}),
            **info,
            **extra,
        },
    )
    preempted = None
    try:
        result = trainer.train()
    except ConfigError as exc:  # e.g. a checkpoint missing a rank's shard: a user problem, said in one line
        _fail(str(exc))
    except Preempted as exc:  # SIGTERM / SIGUSR1: a checkpoint was saved by every rank; a distinct exit code
        preempted = str(exc)  # handled below, once the exception's frames (which hold the trainer) are gone
    except NonFiniteError as exc:  # the numerical guard: one line, no traceback, non-zero exit
        _fail(f"{exc} (checkpoints written so far are intact; --on_nonfinite skip skips such steps instead)")
    except RuntimeError as exc:
        if not _is_collective_timeout(exc):
            raise
        # said by every rank that timed out (a hang is usually one rank's story: name who reports it)
        print(
            f"hfpar: error: rank {accelerator.process_index}: a collective timed out after --dist_timeout_s "
            f"{args.dist_timeout_s}: another rank is stuck or died (see its log); checkpoints written so far are "
            "intact, relaunch with --resume_from_checkpoint latest",
            file=sys.stderr,
        )
        os._exit(3)  # the process group is broken: no clean shutdown is possible
    del trainer, backend, model, objective
    if preempted is not None:
        if accelerator.is_main_process:
            print(f"hfpar: preempted: {preempted}", file=sys.stderr)
        _tear_down(accelerator)
        sys.exit(PREEMPTED_EXIT)
    accelerator.print(f"[hfpar] done: {result}  -> {args.output_dir}")
    _tear_down(accelerator)
    release_output_dir(lock)
    return result
