"""dpo: preference tuning of a causal LM with TRL's DPOTrainer semantics and option names (see recipes/dpo.py).

    from hfpar.recipe import main; main("dpo")      # what recipes/dpo.py runs

Its record: DPOArgs (TRL DPOConfig's options), the pair data (hfpar.data.preference: one row per pair, or pairs
sharing their prompt and packed), its option checks, and DPOObjective with the reference it owns (hfpar.objectives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from hfpar import data
from hfpar.config import RecipeArgs
from hfpar.data import preference
from hfpar.data.share_probe import prompt_sharing_problem
from hfpar.objectives.base import disable_dropout
from hfpar.objectives.preference import LOSS_TYPES, DPOObjective, loss_terms
from hfpar.objectives.reference import FrozenReference, LoRABaseReference, PrecomputedReference, ZeRO3Reference
from hfpar.recipes import Recipe, RecipeData, register


@dataclass
class DPOArgs(RecipeArgs):
    # --- preference tuning (the dpo recipe; TRL DPOConfig's names) -------------------------------
    beta: float = 0.1  # deviation from the reference (ipo: its tau)
    # sigmoid | hinge | ipo | robust | apo_zero | sppo_hard (TRL 1.16's formulas); comma-separated: their weighted sum
    loss_type: str = "sigmoid"
    loss_weights: str | None = None  # comma-separated weights of the --loss_type list (TRL's; default 1 each)
    label_smoothing: float = 0.0  # robust: probability that a preference label is flipped, in [0, 0.5)
    reference_free: bool = False  # no reference model: its log-probs are 0
    precompute_ref_log_probs: bool = (
        False  # reference log-probs computed once before training (no reference forward per step)
    )
    max_length: int | None = (
        None  # prompt + completion tokens per sequence, cut by --truncation_mode; unset = --max_seq_length
    )
    truncation_mode: str = "keep_start"  # keep_start | keep_end (TRL's)
    max_prompt_length: int | None = None  # prompt tokens kept (its end), before --max_length
    max_completion_length: int | None = None  # completion tokens kept (its start), before --max_length
    disable_dropout: bool = True  # set every dropout module's p to 0, LoRA's too (TRL's default)


def dpo_problems(args, ctx, model_type: str | None = None, why_not_packed: str | None = None) -> list[str]:
    """Option problems of the dpo recipe, one line each."""
    p = []
    if any(t not in LOSS_TYPES for t in args.loss_type.split(",")):
        p.append(
            f"--loss_type {args.loss_type!r}: valid values are {', '.join(LOSS_TYPES)}, or a comma-separated "
            "list of them (their weighted sum, --loss_weights)"
        )
    elif loss_terms(args.loss_type, args.loss_weights) is None:
        p.append(
            f"--loss_weights {args.loss_weights!r}: one number per --loss_type entry "
            f"({len(args.loss_type.split(','))}), comma-separated"
        )
    if args.beta <= 0:
        p.append(f"--beta {args.beta}: must be > 0")
    if not 0.0 <= args.label_smoothing < 0.5:
        p.append(f"--label_smoothing {args.label_smoothing}: must be in [0, 0.5)")
    if args.truncation_mode not in ("keep_start", "keep_end"):
        p.append(f"--truncation_mode {args.truncation_mode!r}: valid values are keep_start, keep_end")
    for name in ("max_length", "max_prompt_length", "max_completion_length"):
        v = getattr(args, name)
        if v is not None and v < 2:
            p.append(f"--{name} {v}: must be >= 2 tokens (or unset)")
    if args.reference_free and args.precompute_ref_log_probs:
        p.append("--reference_free with --precompute_ref_log_probs: there is no reference to precompute; pick one")
    if args.packing:
        p.append("--packing: the dpo recipe always packs each pair into one row (chosen and rejected as documents)")
    if why_not_packed:
        p.append(
            f"dpo: each pair is one row of two documents told apart by their position ids, which needs "
            f"packed-sequence attention: {why_not_packed}"
        )
    live = not (args.reference_free or args.precompute_ref_log_probs or args.use_peft)
    if (
        live
        and ctx.strategy.partitions_at_load
        and args.model_name_or_path != data.EMBEDDED
        and is_deepspeed_zero3_enabled()
    ):
        p.append(
            f"the reference model with {ctx.strategy.name} and zero3_init_flag: true: the model loads already "
            "partitioned, so no whole copy of it exists to build the reference from; pass "
            "--precompute_ref_log_probs (the same values, the reference forward done once before training), "
            "--use_peft, or zero3_init_flag: false in the accelerate config"
        )
    return p


def problems(args, ctx, plan) -> list[str]:
    """The option problems; the rows' own: shared-prompt rows carry each pair's attention mask (shares_prompt), so
    any model that takes it trains them; plain pair rows are two documents told apart by their position ids, which
    the model's attention must honour (OPT, BLOOM, GPT-OSS build their mask without them)."""
    if shares_prompt(args, ctx, plan.model_config):
        return dpo_problems(args, ctx)
    # the pair rows are packed documents whatever --padding_free / --pp_size say (a row is a pair)
    _, why_not = data.padding_free_mode(
        dataclasses.replace(args, padding_free=None, pp_size=1), "lm", plan.model_config, packed=False
    )
    return dpo_problems(args, ctx, why_not_packed=why_not)


def shares_prompt(args, ctx, config) -> bool:
    """Whether each pair's prompt is computed once (hfpar.data.preference.PairCollator share_prompt): where the
    model's attention takes the rows' (B, 1, T, T) mask as given, checked on a tiny copy of its config
    (hfpar.data.share_probe: every sequence's logits in shared-prompt rows equal the sequence alone), and neither
    context parallelism (its attention finds the documents from the position ids) nor a pipeline (its stages take
    no attention mask)."""
    if ctx.cp > 1 or ctx.pp > 1 or config is None:
        return False
    return prompt_sharing_problem(config, args.attn_implementation) is None


def packs_pairs(args, plan) -> bool:
    """Whether shared-prompt rows also pack several pairs (PairCollator pack): not for MoE models (upcycled, or a
    config with routed experts), whose expert matmuls take the batch's tokens together: packing changes their
    grouping and the fp32 round-off of the eval rewards' margins in the EP parity run beyond its 1e-5 floor."""
    return not args.upcycle_experts and plan.num_experts is None


def resolve(args, ctx, plan) -> dict:
    share = shares_prompt(args, ctx, plan.model_config)
    return {"share_prompt": share, "pack_pairs": share and packs_pairs(args, plan)}


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    """Pairs, one row each, or sharing their prompt (hfpar.data.preference)."""
    train, stats = preference.load_preference(args, tokenizer)
    evals = preference.load_preference_eval(args, tokenizer) if args.eval_steps != 0 else None
    share = plan.recipe_values["share_prompt"]
    collator = preference.pair_collator(args, tokenizer, ctx.seq_multiple, share, plan.recipe_values["pack_pairs"])
    return RecipeData(train, evals, collator, {"train_data": stats, "dpo_shared_prompt": share})


def objective(args, ctx, plan, model, data: RecipeData) -> DPOObjective:
    """The DPO loss and the reference it owns: none (--reference_free), precomputed log-probs (the initial model,
    before resume), the LoRA base (adapters disabled), a frozen copy of this rank's shards, or under ZeRO-3 (its
    parameters live outside the module between forwards) a copy of the initial model in a DeepSpeed engine of its
    own. Dropout off first with --disable_dropout (TRL's default): the policy's forward is then the reference's."""
    if args.disable_dropout:
        disable_dropout(model)
    if args.reference_free:
        reference = None
    elif args.precompute_ref_log_probs:
        reference = PrecomputedReference()
    elif args.use_peft:
        reference = LoRABaseReference()
    elif ctx.strategy.partitions_at_load:
        reference = ZeRO3Reference(model)
    else:
        reference = FrozenReference()
    return DPOObjective(
        model,
        ctx,
        reference=reference,
        beta=args.beta,
        loss_type=loss_terms(args.loss_type, args.loss_weights),
        label_smoothing=args.label_smoothing,
    )


def packed(args) -> bool:
    return True  # a row holds a pair's two sequences as documents


RECIPE = register(
    Recipe(
        name="dpo",
        task="lm",
        args_class=DPOArgs,
        build_data=build_data,
        packed=packed,
        problems=problems,
        resolve=resolve,
        objective=objective,
        defaults=dict(output_dir="outputs/dpo", learning_rate=1e-6, max_seq_length=1024),  # DPOConfig's
        demo=dict(
            max_steps=120,
            per_device_train_batch_size=16,
            learning_rate=3e-4,
            warmup_ratio=0.05,
            logging_steps=10,
            max_seq_length=128,
            lora_dropout=0.0,
        ),
    )
)
