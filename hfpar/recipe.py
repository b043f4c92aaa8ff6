"""What every recipe does, in order: parse -> validate -> accelerator -> data -> model -> train -> export.

    from hfpar.recipe import main
    main("sft")        # or "clm", "classify"; reads sys.argv

User mistakes (bad options, bad data, an output_dir that holds someone's checkpoints) end with a
one-line `hfpar: error: ...` per problem on stderr and exit code 2, before the model is loaded.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from hfpar.checkpoint import has_any_checkpoint, resolve_resume
from hfpar.config import ConfigError, RecipeArgs, parse_args

TASK_OF = {"sft": "lm", "clm": "lm", "classify": "classify"}

# Embedded defaults: what `python recipes/<kind>.py` with no arguments runs (tiny model, generated data).
RECIPE_DEFAULTS = {
    "sft": dict(output_dir="outputs/sft", max_steps=150, per_device_train_batch_size=16, learning_rate=1e-3,
                warmup_ratio=0.05, eval_steps=50, logging_steps=25, max_seq_length=128),
    "clm": dict(output_dir="outputs/clm", max_steps=150, per_device_train_batch_size=16, learning_rate=3e-3,
                warmup_ratio=0.05, eval_steps=50, logging_steps=25, max_seq_length=128),
    "classify": dict(output_dir="outputs/classify", max_steps=150, per_device_train_batch_size=32,
                     learning_rate=2e-3, warmup_ratio=0.05, eval_steps=50, logging_steps=25, max_seq_length=64),
}


def _fail(problems: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        for line in str(problems).splitlines():
            print(f"hfpar: error: {line}", file=sys.stderr)
    sys.exit(2)


def _is_collective_timeout(exc: BaseException) -> bool:
    """gloo: RuntimeError '... Timed out waiting Nms for recv ...'; torch wraps backend failures in
    DistBackendError (a RuntimeError). NCCL's watchdog aborts the process itself, with its own message."""
    text = str(exc).lower()
    return isinstance(exc, torch.distributed.DistBackendError) or "timed out" in text or "timeout" in text


def check_output_dir(args: RecipeArgs) -> None:
    """Never write over someone's checkpoints without an explicit flag."""
    if has_any_checkpoint(args.output_dir) and not args.resume_from_checkpoint and not args.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {args.output_dir} already holds checkpoints; pass --resume_from_checkpoint latest to continue "
            "or --overwrite_output_dir to start over there (or pick another --output_dir)")
    resolve_resume(args.resume_from_checkpoint, args.output_dir)  # a bad PATH fails here, before any work


def check_parallel_support(args: RecipeArgs, accelerator, task: str) -> None:
    """Combinations that are not implemented yet end here, before the model is loaded."""
    import importlib.util

    from hfpar.distributed import strategy_name

    strategy = strategy_name(accelerator)
    model_parallel = [f"--{k} {getattr(args, k)}" for k in ("tp_size", "ep_size") if getattr(args, k) > 1]
    model_parallel += [f"--upcycle_experts {args.upcycle_experts}"] if args.upcycle_experts else []
    if args.use_peft and importlib.util.find_spec("peft") is None:
        raise ConfigError("--use_peft needs the peft package: pip install 'hfpar[peft]' (or pip install peft)")
    if args.use_peft and model_parallel:
        raise ConfigError(f"--use_peft with {' and '.join(model_parallel)}: LoRA composes with the data-parallel "
                          "strategies only (single, ddp, fsdp2, zero1/2/3); drop the TP / EP options")
    if args.tp_size > 1:
        if strategy not in ("single", "ddp", "fsdp2", "zero1", "zero2"):
            raise ConfigError(f"--tp_size {args.tp_size} with {strategy}: tensor parallelism composes with single, ddp, "
                              "fsdp2, zero1 and zero2 configs (ZeRO-3 would partition the TP shards again; use fsdp2.yaml "
                              "for sharded data parallelism with TP)")
        if task != "lm" and args.sequence_parallel:
            raise ConfigError("--sequence_parallel: needs a causal-LM recipe (sft, clm), whose vocab-parallel LM head "
                              "gathers the sequence back; classify supports --tp_size without it")
    if args.on_nonfinite == "skip" and strategy.startswith("zero"):
        raise ConfigError(f"--on_nonfinite skip with {strategy}: DeepSpeed steps its optimizer inside "
                          "backward, so a step cannot be skipped; use --on_nonfinite error (stops at the bad step)")
    if args.ep_size > 1 and strategy not in ("single", "ddp", "fsdp2", "zero1", "zero2"):
        raise ConfigError(f"--ep_size {args.ep_size} with {strategy}: expert parallelism composes with ddp, fsdp2, "
                          "zero1 and zero2 configs (ZeRO-3 would partition each rank's experts again over ranks "
                          "holding different experts; use zero2.yaml or fsdp2.yaml)")
    if args.ep_size > 1 and strategy in ("zero1", "zero2") and accelerator.mixed_precision == "fp16":
        raise ConfigError(f"--ep_size {args.ep_size} with {strategy} and fp16: the experts' optimizer does not "
                          "unscale DeepSpeed's fp16 loss scale; use bf16 or fp32")
    if (args.ep_size > 1 or args.upcycle_experts) and task != "lm":
        raise ConfigError("--ep_size / --upcycle_experts: available for causal-LM recipes (sft, clm)")
    if args.ep_size > 1 and args.gradient_checkpointing:
        raise ConfigError(f"--ep_size {args.ep_size} with --gradient_checkpointing: not supported yet (MoE token masks "
                          "are published for the forward only)")


def prepare_moe(args: RecipeArgs, model, dims) -> None:
    """Upcycle (--upcycle_experts) and make MoE layers expert-parallel over --ep_size ranks. Any MoE model
    gets router statistics over all data-parallel ranks, so EP and DP do not change the aux loss."""
    import torch.distributed as dist

    from hfpar.parallel.moe_apply import apply_expert_parallel, expert_parallel_groups, upcycle_to_moe

    if args.upcycle_experts:
        upcycle_to_moe(model, args.upcycle_experts, args.moe_top_k, aux_loss_coef=args.moe_aux_loss_coef,
                       z_loss_coef=args.moe_z_loss_coef, seed=args.seed)
    is_moe = args.upcycle_experts or any(type(m).__name__.endswith("SparseMoeBlock") for m in model.modules())
    if args.ep_size > 1 and not is_moe:
        raise ValueError(f"--ep_size {args.ep_size}: {type(model).__name__} has no MoE layers; "
                         "pass --upcycle_experts N to turn its MLPs into experts first")
    if is_moe and dist.is_initialized():
        ep_group, edp_group = expert_parallel_groups(args.ep_size)
        apply_expert_parallel(model, ep_group, dp_group=dist.group.WORLD, edp_group=edp_group)
    elif is_moe:  # one process: the same hfpar MoE layers (and aux-loss injection) as distributed runs
        apply_expert_parallel(model)


@contextlib.contextmanager
def _without_zero3_init():
    """Build the embedded (tiny, random-init) model outside DeepSpeed's zero.Init, so its initial weights are
    the same under every strategy; real checkpoints still load partitioned (zero3_init_flag) via from_pretrained."""
    from transformers.integrations import deepspeed as hf_ds

    from hfpar.distributed import swapped

    with swapped(hf_ds, "_hf_deepspeed_config_weak_ref", None):
        yield


def load_model(args: RecipeArgs, task: str, num_labels: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from hfpar import data

    cls = AutoModelForCausalLM if task == "lm" else AutoModelForSequenceClassification
    extra = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.model_name_or_path == data.EMBEDDED:
        config = AutoConfig.from_pretrained(data.embedded_model_path())
        if num_labels is not None:
            config.num_labels = num_labels
        torch.manual_seed(args.seed)  # same init on every rank
        with _without_zero3_init():
            return cls.from_config(config, **extra)
    kw = {"num_labels": num_labels} if num_labels is not None else {}
    # fp32 master weights; the accelerate config's mixed_precision decides the compute dtype.
    model = cls.from_pretrained(args.model_name_or_path, dtype=torch.float32, **kw, **extra)
    if task == "classify" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def fsdp2_wrap_classes(model) -> None:
    """Accelerate's FSDP2 makes one unit per class in model._no_split_modules and then another for the input
    embedding; when such a class contains the embedding (BERT's BertEmbeddings) the second `fully_shard` fails
    on an already sharded weight ("value was None when it should not be"). Drop those classes: the embedding
    still gets a unit of its own."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = getattr(model, "_no_split_modules", None)
    if emb is None or not names:
        return
    holders = {type(m).__name__ for m in model.modules() if m is not emb and any(c is emb for c in m.modules())}
    if holders & set(names):
        model._no_split_modules = [n for n in names if n not in holders]


def build_data(args: RecipeArgs, kind: str, tokenizer):
    """-> train_ds, eval_ds, collator, info (dict for run_info), num_labels."""
    from hfpar import data

    splits = data.load_splits(args.dataset_name, kind, eval_split_fraction=args.eval_split_fraction, seed=args.seed)
    info, num_labels = {}, None
    out = {}
    for name in ("train", "eval"):
        ds = splits[name]
        if kind == "sft":
            ds, stats = data.tokenize_sft(ds, tokenizer, args.max_seq_length,
                                          completion_only_loss=args.completion_only_loss, truncation=args.truncation)
            if args.packing:
                ds = data.pack(ds, args.max_seq_length)
        elif kind == "clm":
            ds, stats = data.tokenize_clm(ds, tokenizer, args.max_seq_length)
        else:
            ds, stats, num_labels = data.tokenize_classify(ds, tokenizer, args.max_seq_length, truncation=args.truncation)
        out[name] = ds
        info[f"{name}_data"] = {**stats, "rows": len(ds)}
    # sequence parallelism splits T over the TP ranks: pad every batch to a multiple of tp
    collator = data.DataCollator(tokenizer, task=TASK_OF[kind],
                                 pad_to_multiple_of=args.tp_size if args.sequence_parallel else None)
    return out["train"], out["eval"], collator, info, num_labels


def main(kind: str, argv: list[str] | None = None) -> dict:
    from accelerate.utils import set_seed

    from hfpar import data
    from hfpar.distributed import build_groups, setup_accelerator, strategy_name
    from hfpar.trainer import Trainer

    task = TASK_OF[kind]
    try:
        args = parse_args(argv, recipe=kind, defaults=RECIPE_DEFAULTS[kind])
        check_output_dir(args)
    except ConfigError as exc:
        _fail(str(exc))
    log_with = None if args.report_to == "none" else [t.strip() for t in args.report_to.split(",")]
    try:
        accelerator, dims = setup_accelerator(args, log_with=log_with, project_dir=args.output_dir)
        check_parallel_support(args, accelerator, task)
        set_seed(args.seed)
        tokenizer = data.load_tokenizer(args.tokenizer_path)
        with accelerator.main_process_first():
            train_ds, eval_ds, collator, info, num_labels = build_data(args, kind, tokenizer)
    except (ConfigError, data.DataError) as exc:
        _fail(str(exc))
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()
    if log_with:
        from hfpar.config import to_dict

        accelerator.init_trackers(args.run_name or f"hfpar-{kind}", config=to_dict(args))
    model = load_model(args, task, num_labels)
    if strategy_name(accelerator) == "fsdp2":
        fsdp2_wrap_classes(model)
    if args.use_peft:  # before TP / MoE (refused with LoRA) and the data-parallel wrap
        from hfpar.lora import apply_lora, trainable_summary

        try:
            model = apply_lora(model, args, task)
        except ValueError as exc:  # target modules not in the model
            _fail(str(exc))
        info["peft"] = {"lora_r": args.lora_r, "lora_alpha": args.lora_alpha, **trainable_summary(model)}
    groups = build_groups(dims)
    if args.tp_size > 1:
        from hfpar.parallel.apply import apply_tensor_parallel

        try:
            apply_tensor_parallel(model, groups[0], sequence_parallel=args.sequence_parallel)
        except ValueError as exc:  # degrees that do not divide the model's sizes, unknown architecture
            _fail(str(exc))
    if task == "lm":
        try:
            prepare_moe(args, model, dims)
        except ValueError as exc:  # dense model with --ep_size, experts not divisible, unknown MoE family
            _fail(str(exc))
    trainer = Trainer(args, accelerator, dims, model, tokenizer, train_ds, eval_ds, collator, task=task,
                      run_extra={"recipe": kind, "sequence_parallel": args.sequence_parallel, **info}, groups=groups)
    from hfpar.trainer import NonFiniteError

    try:
        result = trainer.train()
    except ConfigError as exc:  # e.g. a checkpoint from an incompatible run: a user problem, said in one line
        _fail(str(exc))
    except NonFiniteError as exc:  # the numerical guard: one line, no traceback, non-zero exit
        _fail(f"{exc} (checkpoints written so far are intact; --on_nonfinite skip skips such steps instead)")
    except RuntimeError as exc:
        if not _is_collective_timeout(exc):
            raise
        # said by every rank that timed out (a hang is usually one rank's story: name who reports it)
        print(f"hfpar: error: rank {accelerator.process_index}: a collective timed out after --dist_timeout_s "
              f"{args.dist_timeout_s}: another rank is stuck or died (see its log); checkpoints written so far are "
              "intact, relaunch with --resume_from_checkpoint latest", file=sys.stderr)
        os._exit(3)  # the process group is broken: no clean shutdown is possible
    accelerator.print(f"[hfpar] done: {result}  -> {args.output_dir}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result
