"""What the dpo recipe adds to hfpar.recipe's run: its option checks (before the model loads), its objective,
and the reference it trains against.

    dpo_preflight(args, ctx)                         # ConfigError, one line per problem
    objective = dpo_objective(args, ctx, model)      # after parallelize, before the data-parallel wrap
    trainer = Trainer(..., loss_fn=objective)
    attach_reference(objective, trainer, args)       # after the wrap (FSDP2 replaced the parameters), before resume
"""

from __future__ import annotations

import contextlib
import dataclasses

from hfpar.config import ConfigError

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "apo_zero", "sppo_hard")


def dpo_problems(args, ctx, model_type: str | None = None, why_not_packed: str | None = None) -> list[str]:
    """Option problems of the dpo recipe, one line each."""
    p = []
    if any(t not in LOSS_TYPES for t in args.loss_type.split(",")):
        p.append(f"--loss_type {args.loss_type!r}: valid values are {', '.join(LOSS_TYPES)}, or a comma-separated "
                 "list of them (their weighted sum, --loss_weights)")
    elif loss_terms(args.loss_type, args.loss_weights) is None:
        p.append(f"--loss_weights {args.loss_weights!r}: one number per --loss_type entry "
                 f"({len(args.loss_type.split(','))}), comma-separated")
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
        p.append(f"dpo: each pair is one row of two documents told apart by their position ids, which needs "
                 f"packed-sequence attention: {why_not_packed}")
    swap = not (args.reference_free or args.precompute_ref_log_probs or args.use_peft)
    if swap and ctx.strategy.partitions_at_load:
        p.append(f"the reference model with {ctx.strategy.name}: its parameters live outside the module between "
                 "forwards, so no frozen copy can be swapped in; pass --precompute_ref_log_probs (the same values, "
                 "the reference forward done once before training) or --use_peft")
    return p


def loss_terms(loss_type: str, loss_weights: str | None) -> list[tuple[str, float]] | None:
    """[(loss type, weight), ...] of --loss_type / --loss_weights (TRL's multi-loss: the weighted sum of the per-pair
    losses, e.g. MPO); None where the weights are not one number per type."""
    types = loss_type.split(",")
    try:
        weights = [float(w) for w in loss_weights.split(",")] if loss_weights is not None else [1.0] * len(types)
    except ValueError:
        return None
    return list(zip(types, weights)) if len(weights) == len(types) else None


def dpo_preflight(args, ctx) -> None:
    # hfpar.preflight's model-config reader: here, not at the top, as hfpar.recipe imports this module first
    from hfpar.preflight import padding_free_mode  # noqa: PLC0415

    # the pair rows are packed documents whatever --padding_free / --pp_size say (a row is a pair)
    _, why_not = padding_free_mode(dataclasses.replace(args, padding_free=None, pp_size=1), "lm", packed=False)
    problems = dpo_problems(args, ctx, why_not_packed=why_not)
    if problems:
        raise ConfigError("\n".join(problems))


# families whose attention takes a custom (B, 1, T, T) mask as given (transformers' masking_utils returns a 4D
# attention_mask unchanged) and has no layer of its own kind (sliding windows: checked on the config)
PROMPT_SHARING = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo2", "phi3")


def shares_prompt(args, ctx) -> bool:
    """Whether each pair's prompt is computed once (hfpar.data.preference.PairCollator share_prompt): sdpa attention
    (a boolean mask; eager adds masks as floats), a family of PROMPT_SHARING without sliding windows, and neither
    context parallelism (its attention finds the documents from the position ids) nor a pipeline (its stages take
    no attention mask)."""
    # the model-config reader of hfpar.preflight (imported here: hfpar.recipe imports this module first)
    from hfpar.preflight import _model_config  # noqa: PLC0415

    if ctx.cp > 1 or ctx.pp > 1 or args.attn_implementation not in (None, "sdpa"):
        return False
    config, _ = _model_config(args)
    if config is None or getattr(config, "model_type", None) not in PROMPT_SHARING:
        return False
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return not windowed and "sliding_attention" not in (getattr(config, "layer_types", None) or ())


def packs_pairs(args) -> bool:
    """Whether shared-prompt rows also pack several pairs (PairCollator pack): not for MoE models (upcycled, or a
    config with experts), whose expert matmuls take the batch's tokens together: packing changes their grouping and
    the fp32 round-off of the eval rewards' margins in the EP parity run beyond its 1e-5 floor."""
    # the model-config reader of hfpar.preflight (imported here: hfpar.recipe imports this module first)
    from hfpar.preflight import _model_config  # noqa: PLC0415

    if args.upcycle_experts:
        return False
    config, _ = _model_config(args)
    return not any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def dpo_objective(args, ctx, model):
    # after the preflight: the objective pulls the tensor-parallel loss in (see hfpar.recipe's late imports)
    from hfpar.train.dpo import DPOObjective  # noqa: PLC0415

    return DPOObjective(model, ctx, beta=args.beta, loss_type=loss_terms(args.loss_type, args.loss_weights),
                        label_smoothing=args.label_smoothing,
                        reference_free=args.reference_free)


def attach_reference(objective, trainer, args) -> None:
    """The reference: none (reference_free), precomputed log-probs (the model is still the reference: before
    resume loads a checkpoint), the LoRA base (adapters disabled) or a frozen copy of this rank's shards."""
    from hfpar.train.dpo import (  # noqa: PLC0415  (as above)
        FrozenCopy, WithReference, adapters_disabled, precompute_eval_reference, precompute_reference)

    if args.reference_free:
        return
    if args.use_peft:
        objective.reference = lambda: adapters_disabled(trainer.model)
    elif not args.precompute_ref_log_probs:
        objective.reference = FrozenCopy(trainer.model)
    if args.precompute_ref_log_probs:
        objective.reference = contextlib.nullcontext   # the model has not been trained yet: it is the reference
        trainer.train_ds = WithReference(trainer.train_ds, precompute_reference(objective, trainer))
        if trainer.eval_ds is not None and len(trainer.eval_ds):
            trainer.eval_ds = WithReference(trainer.eval_ds, precompute_eval_reference(objective, trainer))
        objective.reference = None   # no reference forward during training, no frozen copy held
