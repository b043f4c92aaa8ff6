"""grpo: online RL of a causal LM on rewards (GRPO and its variants: DAPO, Dr. GRPO, GSPO, CISPO; RLOO's advantage)
with TRL 1.16 GRPOTrainer's semantics and option names (see recipes/grpo.py, docs/grpo.md).

    from hfpar.recipe import main; main("grpo")      # what recipes/grpo.py runs

Its record: GRPOArgs (GRPOConfig's options), prompt-only data (hfpar.data.prompts), its option checks, and
GRPOObjective (hfpar.objectives.policy) with its rollout (hfpar.rollout.loop) and, with --beta > 0, the reference it
owns (hfpar.objectives.reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from hfpar import data
from hfpar.config import RecipeArgs
from hfpar.data import DataError, prompts
from hfpar.objectives.base import disable_dropout
from hfpar.objectives.policy import GRPOObjective
from hfpar.objectives.reference import FrozenReference, LoRABaseReference, ZeRO3Reference
from hfpar.recipes import Recipe, RecipeData, register
from hfpar.rollout.advantages import SCALE_REWARDS
from hfpar.rollout.collate import RolloutCollator
from hfpar.rollout.engine import (
    GenerationConfig,
    InPlaceEngine,
    ReplicaEngine,
    checkpoint_generation_config,
    eos_token_ids,
)
from hfpar.rollout.loop import Rollout, RolloutConfig
from hfpar.rollout.policy_loss import IMPORTANCE_LEVELS, LOSS_TYPES, PolicyLossConfig
from hfpar.rollout.reward_log import RunProgress
from hfpar.rollout.rewards import RewardError, resolve_reward_funcs
from hfpar.rollout.schedule import RolloutSchedule
from hfpar.train import VARLEN
from hfpar.train.sampler import total_steps

ESTIMATORS = ("grpo", "rloo")


@dataclass
class GRPOArgs(RecipeArgs):
    # --- online RL (the grpo recipe; TRL GRPOConfig's names) ---------------------------------------------
    reward_funcs: str = "exact_match"  # comma-separated: built-ins, module.path:function, reward-model dirs
    reward_weights: str | None = None  # comma-separated, one per --reward_funcs entry (default 1 each)
    num_generations: int = 8  # completions per prompt (a group)
    num_generations_eval: int | None = None  # completions per eval prompt (default num_generations)
    generation_batch_size: int | None = None  # completions per generation (default: the global batch)
    steps_per_generation: int | None = None  # micro-steps per generation (default: gradient_accumulation_steps)
    num_iterations: int = 1  # times each generation batch is trained on (old log-probs, importance ratio)
    max_prompt_length: int | None = 512  # longer prompts are refused, not cut (None: no limit)
    max_completion_length: int = 512  # new tokens per completion (GRPOConfig's)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float | None = None  # None: off (or the checkpoint's generation_config's, as TRL)
    repetition_penalty: float = 1.0  # TRL's default: a checkpoint's own (Qwen2.5-Instruct's 1.05) does not apply
    generation_kwargs: str | None = None  # extra generation settings, a JSON / YAML mapping (TRL's): min_new_tokens
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo | cispo
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    epsilon: float = 0.2  # lower clip of the ratio (1 - epsilon)
    epsilon_high: float | None = None  # upper clip (1 + epsilon_high; default epsilon; cispo: its cap, 5.0 suggested)
    delta: float | None = None  # two-sided GRPO: cap on the unclipped ratio (None: off)
    scale_rewards: str = "group"  # group | batch | none
    mask_truncated_completions: bool = False  # completions without EOS take no part in the loss
    beta: float = 0.0  # KL coefficient to the reference model (0: no reference, TRL's default)
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio (TRL's default)
    advantage_estimator: str = "grpo"  # grpo | rloo (RLOOTrainer's leave-one-out baseline)
    normalize_advantages: bool = False  # rloo: standardize the advantages over the batch (RLOOConfig's)
    log_completions: bool = False  # write every completion, its reward and advantage to completions.jsonl
    disable_dropout: bool = False  # set every dropout module's p to 0, LoRA's too (GRPOConfig's default: off)


def _list(text: str | None) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()] if text else []


GENERATION_KWARGS = ("min_new_tokens",)  # --generation_kwargs keys hfpar's mesh-independent sampler honours


def generation_kwargs(text: str | None) -> dict:
    """--generation_kwargs as a mapping (TRL's GRPOConfig.generation_kwargs, given as JSON on its command line);
    ValueError naming what is wrong."""
    if not text:
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"--generation_kwargs {text!r}: expected a mapping, e.g. '{{\"min_new_tokens\": 64}}'")
    other = sorted(set(value) - set(GENERATION_KWARGS))
    if other:
        raise ValueError(
            f"--generation_kwargs: {', '.join(other)} not supported (supported: {', '.join(GENERATION_KWARGS)})"
        )
    n = value.get("min_new_tokens", 0)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"--generation_kwargs min_new_tokens {n!r}: must be an integer >= 0")
    return value


def schedule(args, ctx, num_prompts: int) -> RolloutSchedule:
    spg = args.steps_per_generation
    if spg is None and args.generation_batch_size is not None:
        spg = args.generation_batch_size // (args.per_device_train_batch_size * ctx.dp)
    return RolloutSchedule(
        num_prompts=num_prompts,
        num_generations=args.num_generations,
        per_device=args.per_device_train_batch_size,
        dp=ctx.dp,
        accum=args.gradient_accumulation_steps,
        steps_per_generation=spg if spg is not None else args.gradient_accumulation_steps,
        num_iterations=args.num_iterations,
        seed=args.seed,
    )


def problems(args, ctx, plan) -> list[str]:
    """Option problems of the grpo recipe, one line each (before the model loads)."""
    p = []
    for name, value, valid in (
        ("loss_type", args.loss_type, LOSS_TYPES),
        ("importance_sampling_level", args.importance_sampling_level, IMPORTANCE_LEVELS),
        ("scale_rewards", args.scale_rewards, SCALE_REWARDS),
        ("advantage_estimator", args.advantage_estimator, ESTIMATORS),
    ):
        if value not in valid:
            p.append(f"--{name} {value!r}: valid values are {', '.join(valid)}")
    if args.generation_batch_size is not None and args.steps_per_generation is not None:
        p.append("--generation_batch_size and --steps_per_generation: set one of them (TRL's rule)")
    elif args.generation_batch_size is not None and args.generation_batch_size % (
        args.per_device_train_batch_size * ctx.dp
    ):
        p.append(
            f"--generation_batch_size {args.generation_batch_size}: must be a multiple of the global micro-batch "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x dp {ctx.dp})"
        )
    else:
        p += [x for x in schedule(args, ctx, 10**9).problems() if "prompts" not in x]
    if args.attn_implementation == VARLEN:
        p.append(
            f"--attn_implementation {VARLEN}: computes training forwards only, and grpo generates with a KV "
            "cache; use sdpa or flash_attention_2"
        )
    if args.max_completion_length < 1:
        p.append(f"--max_completion_length {args.max_completion_length}: must be >= 1")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        p.append(f"--max_prompt_length {args.max_prompt_length}: must be >= 1 (or None)")
    if args.temperature <= 0:
        p.append(f"--temperature {args.temperature}: must be > 0")
    if not 0 < args.top_p <= 1:
        p.append(f"--top_p {args.top_p}: must be in (0, 1]")
    if args.top_k < 0:
        p.append(f"--top_k {args.top_k}: must be >= 0 (0: off)")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        p.append(f"--min_p {args.min_p}: must be in [0, 1] (or None: off)")
    if args.repetition_penalty <= 0:
        p.append(f"--repetition_penalty {args.repetition_penalty}: must be > 0 (1.0: off)")
    try:
        extra = generation_kwargs(args.generation_kwargs)
        if extra.get("min_new_tokens", 0) > args.max_completion_length:
            p.append(
                f"--generation_kwargs min_new_tokens {extra['min_new_tokens']}: above --max_completion_length "
                f"{args.max_completion_length}"
            )
    except ValueError as exc:
        p.append(str(exc))
    if args.beta < 0:
        p.append(f"--beta {args.beta}: must be >= 0")
    if not 0 <= args.epsilon < 1:
        p.append(f"--epsilon {args.epsilon}: must be in [0, 1)")
    try:
        weights = [float(w) for w in _list(args.reward_weights)] if args.reward_weights else None
        resolve_reward_funcs(_list(args.reward_funcs), weights)
    except ValueError as exc:
        p.append(str(exc) if isinstance(exc, RewardError) else f"--reward_weights {args.reward_weights!r}: {exc}")
    if ctx.pp > 1 and (args.use_peft or args.upcycle_experts):
        p.append(
            f"grpo with --pp_size {ctx.pp} and {'--use_peft' if args.use_peft else '--upcycle_experts'}: the "
            "generation replica of a pipelined policy is built from the model's own config, which holds neither an "
            "adapter nor upcycled experts; drop one of them"
        )
    if args.sequence_parallel:
        p.append("grpo with --sequence_parallel: decoding one token a step cannot be cut over the tp ranks; drop it")
    if args.num_generations_eval is not None and args.num_generations_eval < 1:
        p.append(f"--num_generations_eval {args.num_generations_eval}: must be >= 1 (or None: num_generations)")
    if args.packing:
        p.append("--packing: grpo's rows are prompt + completion, one per row; drop it")
    reshaped = ctx.tp > 1 or ctx.ep > 1 or args.upcycle_experts
    if (
        args.beta
        and not args.use_peft
        and reshaped
        and ctx.strategy.partitions_at_load
        and is_deepspeed_zero3_enabled()
    ):
        p.append(
            f"--beta {args.beta} with {ctx.strategy.name}, zero3_init_flag: true and tp / ep / upcycled experts: the "
            "reference model needs a whole copy of the initial model, which a model loaded already partitioned "
            "does not have; pass zero3_init_flag: false in the accelerate config, --use_peft (the reference is "
            "the base), or --beta 0"
        )
    return p


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    """The prompts (hfpar.data.prompts), and the rollout's rows as the trainer's training set."""
    train, evals, stats = prompts.load_prompts(args, tokenizer)
    sched = schedule(args, ctx, len(train))
    bad = sched.problems()
    if bad:
        raise DataError(bad[0])
    rows = RolloutRows(train, sched, tokenizer)
    collator = RolloutCollator(tokenizer.pad_token_id or 0, ctx.seq_multiple)
    return RecipeData(rows, evals, collator, {"train_data": stats, "grpo_generation_batch": sched.generation_batch})


class RolloutRows:
    """The training set as the trainer counts it: the completion rows an epoch trains on (each generation batch
    num_iterations times); its rows are made by the rollout (GRPOObjective.step_samples), not read by index."""

    def __init__(self, prompts, schedule: RolloutSchedule, tokenizer):
        self.prompts, self.schedule, self.tokenizer = prompts, schedule, tokenizer

    def __len__(self) -> int:
        return self.schedule.rows_per_epoch

    def __getitem__(self, i):
        raise IndexError("grpo's rows come from the rollout (GRPOObjective.step_samples)")


def progress(args, ctx, sched: RolloutSchedule) -> RunProgress:
    """The run's numbers the reward functions' trainer_state carries, as the trainer counts them (its sampler's
    steps per epoch over the rollout's rows, max_steps or the epochs' steps)."""
    global_batch = args.per_device_train_batch_size * ctx.dp * args.gradient_accumulation_steps
    per_epoch = max(1, sched.rows_per_epoch // global_batch)
    return RunProgress(
        max_steps=total_steps(args.max_steps, args.num_train_epochs, per_epoch),  # as the trainer counts them
        steps_per_epoch=per_epoch,
        logging_steps=args.logging_steps,
        eval_steps=args.eval_steps or 0,
        save_steps=args.save_steps or 0,
        train_batch_size=args.per_device_train_batch_size,
    )


def objective(args, ctx, plan, model, data_: RecipeData) -> GRPOObjective:
    if args.disable_dropout:  # before the reference copy (beta > 0) is made: both without dropout, as TRL
        disable_dropout(model)
    rows: RolloutRows = data_.train
    sched, tok = rows.schedule, rows.tokenizer
    cfg = PolicyLossConfig(
        loss_type=args.loss_type,
        importance_sampling_level=args.importance_sampling_level,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,  # None: epsilon, for every loss type (TRL's rule; cispo: 5.0 recommended)
        delta=args.delta,
        beta=args.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,  # the log-probs' and entropies' distribution is the sampler's (TRL's)
    )
    if args.beta == 0.0:
        reference = None
    elif args.use_peft:
        reference = LoRABaseReference()
    elif ctx.strategy.partitions_at_load:  # loaded partitioned: the reference read again from the model's files
        reference = ZeRO3Reference(
            model, source=None if args.model_name_or_path == data.EMBEDDED else args.model_name_or_path
        )
    else:
        reference = FrozenReference()
    specs = _list(args.reward_funcs)
    weights = [float(w) for w in _list(args.reward_weights)] if args.reward_weights else [1.0] * len(specs)
    # TRL's generation settings, the checkpoint's generation_config completing them; its EOS ids stop completions
    checkpoint = checkpoint_generation_config(
        None if args.model_name_or_path == data.EMBEDDED else args.model_name_or_path, model
    )
    generation = GenerationConfig(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_new_tokens=generation_kwargs(args.generation_kwargs).get("min_new_tokens", 0),
        eos_token_id=eos_token_ids(checkpoint, tok.eos_token_id),
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        bos_token_id=tok.bos_token_id,
        checkpoint=checkpoint,
    )
    # a pipeline holds no whole model on a rank: a replica synced from the stages generates
    engine = ReplicaEngine(generation, ctx) if ctx.pp > 1 else InPlaceEngine(generation)
    rollout = Rollout(
        sched,
        rows.prompts,
        tok,
        engine,
        resolve_reward_funcs(specs, weights),
        weights,
        ctx,
        RolloutConfig(
            advantage=args.advantage_estimator,
            scale_rewards=args.scale_rewards,
            normalize_advantages=args.normalize_advantages,
            mask_truncated_completions=args.mask_truncated_completions,
            eval_generations=args.num_generations_eval or args.num_generations,
            old_logps=sched.num_iterations > 1 or sched.steps_per_pass > 1,
            ref_logps=args.beta != 0.0,
            seed=args.seed,
            log_completions=str(Path(args.output_dir) / "completions.jsonl") if args.log_completions else None,
            progress=progress(args, ctx, sched),
        ),
        plan.cp_mode,
    )
    return GRPOObjective(model, ctx, cfg=cfg, reference=reference, rollout=rollout)


RECIPE = register(
    Recipe(
        name="grpo",
        task="lm",
        args_class=GRPOArgs,
        build_data=build_data,
        packed=lambda args: True,  # one prompt + completion per row, no packing or padding-free rows
        problems=problems,
        objective=objective,
        defaults=dict(
            output_dir="outputs/grpo",
            model_name_or_path=data.grpo_start_path(),  # the embedded model after a short SFT on the task
            learning_rate=1e-6,  # GRPOConfig's
        ),
        demo=dict(
            max_steps=60,
            per_device_train_batch_size=64,  # 8 prompts x 8 completions a step
            num_generations=8,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            logging_steps=1,
            eval_steps=0,
            max_completion_length=16,
            max_prompt_length=64,
        ),
    )
)
