"""One preflight before any model is loaded: every problem collected, printed once, exit 2.

    ctx, backend_cls, plan = preflight(args, accelerator, "lm", recipe)   # raises ConfigError (one line per problem)

ctx: the ParallelContext (groups not built yet); plan: the RunPlan (hfpar.context), everything the run derives
from its options and the model config, resolved here once. The recipe's own checks (Recipe.problems) run last.

What it checks, reading only options, the accelerate config in effect, the model's config.json and the
resumed checkpoint's trainer_state.json (never a weight):
  - parallel degrees (ParallelContext: world = dp x tp, ep divides dp, ...);
  - the support matrix (hfpar.backends.SUPPORT) and the chosen backend's own constraints;
  - features that do not combine (LoRA with model parallelism, SP / EP outside causal LMs, ...);
  - divisibility known from the model config (heads, kv heads, intermediate, vocab by tp; experts by ep),
    MoE-ness for --ep_size, architectures with a TP plan / an upcycling recipe;
  - resume compatibility (global batch; the mesh: the same, or another one the checkpoint reshards to);
  - --padding_free true where padding-free batches cannot apply (hfpar.data.padding_free).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from typing import Any

from accelerate.utils import DistributedType
from transformers import AutoConfig

from hfpar import data, recipes, train
from hfpar.backends import resolve_strategy, select_backend
from hfpar.backends.launch_config import launch_config_problems
from hfpar.backends.reshard import resume_mode
from hfpar.backends.zero import deepspeed_fp16_problem
from hfpar.checkpoint.file_checks import data_file_problems, weights_problems
from hfpar.checkpoint.layout import RESUME_KEYS, identity_problem, read_trainer_state, resolve_resume
from hfpar.checkpoint.resume_checks import checkpoint_problems
from hfpar.config import ConfigError
from hfpar.context import ParallelContext, RunPlan, model_config_problems
from hfpar.data.vision import image_cp_refusal, is_image_text
from hfpar.loading.lora import lora_config
from hfpar.loading.lora_targets import ep_lora_problem
from hfpar.loading.sources import causal_lm_problem
from hfpar.parallel.chunked_loss import logits_problem
from hfpar.parallel.context_parallel.mixing import token_mixing_problem
from hfpar.parallel.context_parallel.probe import cp_attention_problems
from hfpar.parallel.context_parallel.shard_check import shard_problem
from hfpar.parallel.expert_parallel import config_num_experts, upcycle_problem
from hfpar.parallel.language_model import pipeline_refusal, text_config
from hfpar.parallel.pipeline import microbatches, parse_split, pipeline_problem, pipeline_stages
from hfpar.parallel.tensor_parallel import derived_plan_refusal
from hfpar.parallel.tensor_parallel.plans import TP_PLANS
from hfpar.precision.fp8 import fp8_problems, fp8_settings
from hfpar.train.liger import liger_problems


def preflight(args, accelerator, task: str, recipe: recipes.Recipe | None = None):
    """-> (ParallelContext without groups yet, carrying the strategy in effect; backend class; RunPlan);
    ConfigError listing every problem. recipe: its own checks and resolved values (None: a plain one of `task`)."""
    recipe = recipe if recipe is not None else recipes.Recipe(name=task, task=task)
    strategy = resolve_strategy(accelerator)  # once per run: ctx.strategy from here on
    ctx = ParallelContext(
        world=accelerator.num_processes,
        rank=accelerator.process_index,
        tp=args.tp_size,
        ep=args.ep_size,
        cp=args.cp_size,
        pp=args.pp_size,
        sequence_parallel=args.sequence_parallel,
        strategy=strategy,
    )
    problems = ctx.problems() + launch_config_problems()  # misspelt deepspeed_config / fsdp_config keys
    degrees_ok = not ctx.problems()
    backend_cls = None
    try:  # the composition is known from the flags even when a degree does not fit the world
        backend_cls = select_backend(
            strategy.name,
            ctx.parallelisms,
            {"tp": args.tp_size, "ep": args.ep_size, "cp": args.cp_size, "pp": args.pp_size},
        )
    except ConfigError as exc:
        problems.append(str(exc))
    if accelerator.mixed_precision == "fp16" and not fp16_loss_scaling(accelerator):
        # Accelerate 1.15 builds neither its fp16 autocast nor its GradScaler on CPU (native_amp is off there)
        problems.append(
            f"--mixed_precision fp16 on {accelerator.device.type.upper()}: Accelerate runs no fp16 autocast "
            "and no loss scaling there (the run would silently be fp32); use --mixed_precision bf16 or no"
        )
    if accelerator.mixed_precision == "fp16" and strategy.deepspeed and (p := deepspeed_fp16_problem()):
        problems.append(p)
    if backend_cls is not None:
        problems += backend_cls.check(args, ctx, strategy.name, accelerator.mixed_precision)
    problems += fp8_problems(args, ctx, strategy, accelerator.device)  # mixed_precision fp8 (torchao's float8)
    problems += feature_problems(args, ctx, task)
    config, config_problem = read_model_config(args)  # config.json: read once per run, here
    problems += liger_problems(args, ctx, accelerator.device.type, config)
    if degrees_ok:  # what the model's config says about the degrees
        image_text = recipe.image_text and is_image_text(config)
        problems += [config_problem] if config is None else model_problems(args, ctx, task, config, image_text)
    if not problems and backend_cls is not None:
        problems += resume_problems(args, ctx, backend_cls, config)
    if not problems:  # the files themselves, last (their headers are read): weights present and whole, data UTF-8
        problems += weights_problems(args.model_name_or_path) + data_file_problems(args.dataset_name)
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    plan = resolve_plan(args, ctx, recipe, config)
    problems = recipe.problems(args, ctx, plan)  # the recipe's own checks, on the resolved plan
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    return ctx, backend_cls, plan


def fp16_loss_scaling(accelerator) -> bool:
    """Whether an fp16 run would scale its loss: DeepSpeed with its own loss scaler, else Accelerate's GradScaler
    (built on GPUs; none on CPU, where a run would be fp32 in disguise)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return True
    scaler = getattr(accelerator, "scaler", None)
    return scaler is not None and scaler.is_enabled()


def feature_problems(args, ctx: ParallelContext, task: str) -> list[str]:
    p = []
    if args.use_peft and importlib.util.find_spec("peft") is None:
        p.append("--use_peft needs the peft package: pip install 'hfpar[peft]' (or pip install peft)")
    if args.use_peft and args.upcycle_experts:  # new experts are trained whole, which LoRA's frozen base is not
        p.append(
            f"--use_peft with --upcycle_experts {args.upcycle_experts}: upcycled experts start as copies of the MLP "
            "and only diverge by training them whole, while LoRA freezes them; drop one of the two"
        )
    if ctx.tp > 1 and task != "lm" and args.sequence_parallel:
        p.append(
            f"--sequence_parallel: needs a causal-LM recipe ({recipes.names_of_task('lm')}), whose vocab-parallel "
            "LM head gathers the sequence back; classify supports --tp_size without it"
        )
    if args.sequence_parallel and args.upcycle_experts:
        p.append(
            f"--sequence_parallel with --upcycle_experts {args.upcycle_experts}: the MoE blocks stay whole on every "
            "TP rank and route the full sequence; drop --sequence_parallel"
        )
    if (args.ep_size > 1 or args.upcycle_experts) and task != "lm":
        p.append(f"--ep_size / --upcycle_experts: available for causal-LM recipes ({recipes.names_of_task('lm')})")
    if args.cp_size > 1 and task != "lm":
        p.append(
            f"--cp_size {args.cp_size}: context parallelism is available for causal-LM recipes "
            f"({recipes.names_of_task('lm')})"
        )
    if args.cp_size > 1 and args.attn_implementation not in (None, "sdpa", "eager"):
        p.append(
            f"--cp_size {args.cp_size} with --attn_implementation {args.attn_implementation}: hfpar's context-"
            "parallel attention replaces the model's (SDPA inside, on every device); drop the option or use sdpa"
        )
    if args.pp_size > 1:
        p += pp_feature_problems(args, task)
    return p


def model_problems(args, ctx: ParallelContext, task: str, config=None, image_text: bool = False) -> list[str]:
    """What the model's config says about the options (config: as the preflight read it; None: read here).
    image_text: a recipe of image rows builds it with AutoModelForImageTextToText (no causal-LM class needed)."""
    if config is None:
        config, problem = read_model_config(args)
        if config is None:
            return [problem]
    if task == "lm" and not image_text and (why := causal_lm_problem(config)):  # LLaVA: AutoModelForImageTextToText
        return [why]
    p = model_config_problems(ctx, config)
    model_type = getattr(config, "model_type", None)
    text = text_config(config)  # a multimodal wrapper is parallelized as its language model (Gemma-3: gemma3_text)
    if ctx.tp > 1 and text.model_type not in TP_PLANS:  # else a plan derived from the config's base_model_tp_plan
        refusal = derived_plan_refusal(text)
        if refusal is not None:  # (--sequence_parallel on derived / inferred plans: apply_tensor_parallel's checks)
            p.append(f"--tp_size {ctx.tp}: {refusal.reasons}")
    if ctx.cp > 1:
        # a VLM only AutoModelForImageTextToText builds: refused here (its CP probe cannot build it); one that
        # AutoModelForCausalLM builds too (Gemma-3) is probed, and refused by the sft data if its rows have images
        vlm_only = image_text and causal_lm_problem(config)
        p += [image_cp_refusal(ctx.cp, model_type)] if vlm_only else cp_problems(args, ctx, config)
    if ctx.pp > 1:
        p += pp_model_problems(args, ctx, config)
    if args.loss_chunk_size and task == "lm":  # asked for explicitly (unset: where it is exact, silently)
        if why := logits_problem(config):
            p.append(
                f"--loss_chunk_size {args.loss_chunk_size}: model_type {model_type!r}: {why}, so the chunked loss "
                "would not compute its loss; pass 0 or leave it unset"
            )
        if ctx.pp > 1:
            p.append(
                f"--loss_chunk_size {args.loss_chunk_size} with --pp_size {ctx.pp}: the pipeline's last stage "
                "computes its loss from the logits; pass 0 or leave it unset"
            )
    if args.attn_implementation == train.VARLEN:  # in transformers' registries before the model is built
        train.register_varlen_attention()
    why_not = None
    if args.padding_free or args.attn_implementation == train.VARLEN:  # asked for (unset: decided by the run plan)
        _, why_not = data.padding_free_mode(args, task, config, packed=args.packing)
    if args.padding_free and why_not:  # asked for explicitly (unset: padded batches, said once in the log)
        p.append(f"--padding_free true: {why_not}; drop the option or pass false")
    if args.attn_implementation == train.VARLEN and (why_not or args.padding_free is False):
        why = why_not or "--padding_free false asks for padded rows"
        p.append(f"--attn_implementation {train.VARLEN} takes padding-free rows only, and here {why}; use sdpa")
    elif args.attn_implementation == train.VARLEN and image_text:
        p.append(
            f"--attn_implementation {train.VARLEN}: computes causal attention only, and this vision-language "
            "model's vision encoder attends both ways; use sdpa"
        )
    if task == "lm" and args.upcycle_experts:
        if why := upcycle_problem(config):
            p.append(f"--upcycle_experts {args.upcycle_experts}: model_type {model_type!r} cannot be upcycled: {why}")
        elif args.upcycle_experts % ctx.ep:
            p.append(f"--upcycle_experts {args.upcycle_experts} is not divisible by --ep_size {ctx.ep}")
    if task == "lm" and ctx.ep > 1 and args.use_peft and not args.upcycle_experts:  # adapters EP would bypass
        if why := ep_lora_problem(config, lora_config(args, task), ctx.ep):
            p.append(why)
    if task == "lm" and ctx.ep > 1 and not args.upcycle_experts and config_num_experts(config) is None:
        name = (getattr(config, "architectures", None) or [model_type])[0]
        p.append(
            f"--ep_size {ctx.ep}: {name} has no MoE layers; pass --upcycle_experts N to turn its MLPs into "
            f"experts first (its config declares no routed experts)"
        )
    return p


def cp_problems(args, ctx: ParallelContext, config) -> list[str]:
    """Whether the model's attention goes through transformers' registry with nothing CP cannot honour (probed on
    the meta device: hfpar.parallel.context_parallel.probe), every other module that mixes tokens can run on the whole
    rows (its tiny copy: context_parallel.mixing / gathered), the tiny copy cut over emulated cp ranks computes what it
    computes whole
    (context_parallel.shard_check), and --cp_mode ulysses against the heads (auto: see resolve_cp_mode)."""
    p = [f"--cp_size {ctx.cp}: {x}" for x in cp_attention_problems(config)]
    if not p and (why := token_mixing_problem(config) or shard_problem(config)):  # a token mixer that cannot run on
        p.append(f"--cp_size {ctx.cp}: {why}")  # whole rows; a model that computes otherwise once its rows are cut
    heads = getattr(text_config(config), "num_attention_heads", 0) // ctx.tp
    if args.cp_mode == "ulysses" and heads % ctx.cp:
        p.append(
            f"--cp_mode ulysses: {heads} attention heads{' per TP rank' if ctx.tp > 1 else ''} are not divisible "
            f"by --cp_size {ctx.cp}; use --cp_mode ring (or auto)"
        )
    return p


def pp_feature_problems(args, task: str) -> list[str]:
    p = []
    if task != "lm":
        p.append(
            f"--pp_size {args.pp_size}: pipeline parallelism is available for causal-LM recipes "
            f"({recipes.names_of_task('lm')})"
        )
    m = pipeline_microbatches(args)
    if m == 0:  # interleaved_1f1b's default: no multiple of pp_size divides the batch
        p.append(
            f"--pp_schedule interleaved_1f1b: no multiple of --pp_size {args.pp_size} divides "
            f"--per_device_train_batch_size {args.per_device_train_batch_size}; valid: a batch that is a multiple "
            f"of {args.pp_size}"
        )
    elif args.per_device_train_batch_size % m:
        p.append(
            f"--pp_microbatches {m} does not divide --per_device_train_batch_size "
            f"{args.per_device_train_batch_size}; valid: "
            + ", ".join(
                str(d)
                for d in range(1, args.per_device_train_batch_size + 1)
                if args.per_device_train_batch_size % d == 0
            )
        )
    elif args.pp_schedule == "interleaved_1f1b" and m % args.pp_size:
        p.append(
            f"--pp_microbatches {m}: interleaved_1f1b needs a multiple of --pp_size {args.pp_size} that divides "
            f"--per_device_train_batch_size {args.per_device_train_batch_size}"
        )
    return p


def pp_model_problems(args, ctx: ParallelContext, config) -> list[str]:
    """What the config says about cutting the model into ctx.pp stages (decoder-only, enough layers, the split)."""
    archs = getattr(config, "architectures", None) or []
    name = (archs or [getattr(config, "model_type", "model")])[0]
    if why := pipeline_refusal(config):  # a multimodal wrapper
        return [f"--pp_size {ctx.pp}: {why}"]
    if getattr(config, "is_encoder_decoder", False) or (archs and not any(a.endswith("ForCausalLM") for a in archs)):
        return [
            f"--pp_size {ctx.pp}: {name} is not a decoder-only causal LM; pipeline parallelism cuts the decoder "
            "layers of *ForCausalLM models"
        ]
    layers = getattr(config, "num_hidden_layers", 0)
    if layers < ctx.pp:
        return [f"--pp_size {ctx.pp}: {name} has {layers} decoder layers, fewer than the stages"]
    stages = pipeline_stage_count(args)
    if layers < stages:
        return [
            f"--pp_virtual_stages {args.pp_virtual_stages} x --pp_size {ctx.pp}: {name} has {layers} decoder layers, "
            f"fewer than the {stages} virtual stages; valid: "
            + (f"--pp_virtual_stages 2..{layers // ctx.pp}" if layers >= 2 * ctx.pp else "--pp_schedule 1f1b or gpipe")
        ]
    if why := pipeline_problem(config):  # what the model's forward does between its layers, on its tiny copy
        return [f"--pp_size {ctx.pp}: pipeline stages of {name} would not compute it ({why}); valid: pp_size 1"]
    p = []
    if args.pp_split:
        try:
            parse_split(args.pp_split, layers, stages)
        except ValueError as exc:
            p.append(str(exc))
    return p


def resume_problems(args, ctx: ParallelContext, backend_cls, config=None) -> list[str]:
    """A checkpoint from an incompatible run (this run's strategy: ctx.strategy), found from its trainer_state.json
    and its own files (hfpar.checkpoint.resume_checks: another model's config, planted pickles, RNG files)."""
    path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if path is None:
        return []
    state = read_trainer_state(path, RESUME_KEYS)  # an untrusted file: not hfpar's shape is one line (ConfigError)
    p = checkpoint_problems(path, args, config)
    if args.resume_from_checkpoint == "latest" and (why := identity_problem(state, args, path)):
        p.append(why)  # another run's checkpoint (or one past --max_steps): refused unless passed by its path
    chunks = pipeline_stage_count(args) // ctx.pp  # a rank's state holds its chunks' layers (interleaved: V)
    # the same mesh loads natively; another one through the checkpoint's full form, or is refused (naming both)
    mode, why = resume_mode(backend_cls, state, ctx, chunks)
    if mode is None:
        p.append(f"{path}: {why}")
    elif mode == "reshard" and args.use_peft:
        p.append(
            f"checkpoint {path} was written on another mesh ({state.get('strategy')} x {state.get('world_size')} "
            f"processes) and this run trains LoRA adapters: resume LoRA runs on the checkpoint's mesh"
        )
    global_batch = args.per_device_train_batch_size * ctx.dp * args.gradient_accumulation_steps
    if state["global_batch"] != global_batch:
        p.append(
            f"checkpoint {path} was trained with global batch {state['global_batch']}, this run has {global_batch}; "
            "keep per_device_train_batch_size x dp x gradient_accumulation_steps equal to resume"
        )
    return p


# ---------------------------------------------------------------------------------------- the run plan
def read_model_config(args) -> tuple[Any, str | None]:
    """-> (the model's config, None) or (None, the one-line problem)."""
    name = args.model_name_or_path
    path = data.embedded_model_path(name) if name in data.EMBEDDED_MODELS else name
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=getattr(args, "trust_remote_code", False)), None
    except Exception as exc:  # noqa: BLE001  (any loader failure is the user's path / hub id: one line)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"--model_name_or_path {args.model_name_or_path}: cannot read its config.json ({first})"


def pipeline_microbatches(args) -> int:
    """Micro-batches per accumulation step through the pipeline (0: none fits, which the preflight reports)."""
    if args.pp_size == 1:
        return 1
    return microbatches(args.per_device_train_batch_size, args.pp_size, args.pp_schedule, args.pp_microbatches)


def pipeline_stage_count(args) -> int:
    """Stages the decoder layers are cut into: pp, or pp x --pp_virtual_stages for interleaved_1f1b."""
    return pipeline_stages(args.pp_size, args.pp_schedule, args.pp_virtual_stages)


def resolve_cp_mode(args, tp: int, cp: int, config) -> str:
    """--cp_mode auto: ulysses when the per-TP-rank heads and kv heads divide by cp, else ring."""
    if args.cp_mode != "auto":
        return args.cp_mode
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", 0) // tp
    kv = (getattr(text, "num_key_value_heads", None) or heads * tp) // tp
    return "ulysses" if heads % cp == 0 and kv % cp == 0 else "ring"


def resolve_plan(args, ctx, recipe, config) -> RunPlan:
    """The run plan of a run that passed the preflight (recipe: an hfpar.recipes.Recipe)."""
    model_type = getattr(config, "model_type", None)
    stages = pipeline_stage_count(args)
    image_text = recipe.image_text and is_image_text(config)
    joins = recipe.one_row and not image_text  # the recipe's collator joins rows (image rows: VisionCollator, never)
    padding_free, why_not = data.padding_free_mode(args, recipe.task, config, packed=recipe.packed(args), joins=joins)
    plan = RunPlan(
        recipe=recipe.name,
        task=recipe.task,
        model_config=config,
        model_type=model_type,
        num_experts=config_num_experts(config) if config is not None else None,
        microbatches=pipeline_microbatches(args),
        pipeline_stages=stages,
        chunks_per_rank=stages // ctx.pp,
        padding_free=padding_free,
        one_row=padding_free and joins and data.one_row(args),
        padding_free_why_not=why_not,
        cp_mode=resolve_cp_mode(args, ctx.tp, ctx.cp, config) if ctx.cp > 1 else "ring",
        fp8=fp8_settings(args, all_gather=ctx.strategy.fp8_all_gather and ctx.tp == 1),
        image_text=image_text,
    )
    values = recipe.resolve(args, ctx, plan)
    return dataclasses.replace(plan, recipe_values=types.MappingProxyType(dict(values))) if values else plan
