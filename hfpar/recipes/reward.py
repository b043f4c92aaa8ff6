"""reward: a reward model (sequence classification, one logit) trained on preference pairs with TRL 1.16
RewardTrainer's loss, metrics and option names (see recipes/reward.py).

    from hfpar.recipe import main; main("reward")      # what recipes/reward.py runs

Its record: RewardArgs (TRL RewardConfig's options), the pair data (hfpar.data.reward_pairs: two rows per pair),
its option checks, and RewardObjective (hfpar.objectives.reward). The task is classify: the model head, the
compositions and their refusals are the classify recipe's (DDP, FSDP2, ZeRO-1/2/3, TP without sequence
parallelism, LoRA; no CP / EP / PP: refused by the shared preflight).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfpar import data
from hfpar.config import RecipeArgs
from hfpar.data import reward_pairs
from hfpar.objectives.base import disable_dropout
from hfpar.objectives.reward import RewardObjective
from hfpar.parallel.language_model import text_config
from hfpar.recipes import Recipe, RecipeData, register


@dataclass
class RewardArgs(RecipeArgs):
    # --- reward modelling (the reward recipe; TRL RewardConfig's names) ------------------------------
    center_rewards_coefficient: float | None = None  # weight of mean (r_chosen + r_rejected)^2 in the loss (TRL: 0.01)
    max_length: int | None = None  # longer pairs (chosen or rejected) are left out, as TRL; unset = --max_seq_length
    disable_dropout: bool = True  # set every dropout module's p to 0, LoRA's too (TRL's default)
    eos_token: str | None = None  # the tokenizer's eos (appended to standard-text completions); unset = its own
    pad_to_multiple_of: int | None = None  # pad each batch's rows to a multiple of this many tokens


def problems(args, ctx, plan) -> list[str]:
    """Option problems of the reward recipe, one line each."""
    p = []
    c = args.center_rewards_coefficient
    if c is not None and not c >= 0:
        p.append(f"--center_rewards_coefficient {c}: must be >= 0 (TRL recommends 0.01), or unset")
    for name in ("max_length", "pad_to_multiple_of"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.append(f"--{name} {v}: must be >= 1 (or unset)")
    if args.packing:
        p.append("--packing: the reward recipe reads each sequence's last token: its two rows per pair stay padded")
    config = plan.model_config
    archs = getattr(config, "architectures", None) or []
    labels = getattr(config, "num_labels", 1)
    if any(a.endswith("ForSequenceClassification") for a in archs) and labels != 1:
        p.append(
            f"--model_name_or_path {args.model_name_or_path}: a {archs[0]} with num_labels {labels}; a reward "
            "model has one logit (num_labels 1): start from a causal LM or a 1-label classifier"
        )
    return p


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    """The pairs of the train and eval splits (hfpar.data.reward_pairs), two rows each."""
    if args.eos_token is not None:  # TRL: the tokenizer's eos replaced (and saved with the model)
        if args.eos_token not in tokenizer.get_vocab():
            raise data.DataError(f"--eos_token {args.eos_token!r}: not in the tokenizer's vocabulary")
        tokenizer.eos_token = args.eos_token
    train, stats = reward_pairs.load_reward_split(args, tokenizer, "train")
    evals, eval_stats = reward_pairs.load_reward_split(args, tokenizer, "eval") if args.eval_steps != 0 else (None, {})
    limit = args.max_length or args.max_seq_length
    for split, s in (("train", stats), ("eval", eval_stats)):
        if s.get("filtered_long") and ctx.rank == 0:
            print(
                f"[hfpar] {split} data: {s['filtered_long']} of {s['pairs'] + s['filtered_long']} pairs left out: "
                f"chosen or rejected longer than --max_length {limit} (TRL's filter; raise --max_length to keep them)"
            )
    collator = reward_pairs.RewardCollator(tokenizer.pad_token_id, args.pad_to_multiple_of)
    info = {"train_data": stats, **({"eval_data": eval_stats} if eval_stats else {})}
    return RecipeData(train, evals, collator, info, num_labels=1)


def objective(args, ctx, plan, model, built) -> RewardObjective:
    """The reward loss; the model's config told the tokenizer's pad token (TRL: the last non-pad token of a row is
    the one scored) and, with --eos_token, its eos; dropout off with --disable_dropout (TRL's default)."""
    tok = data.load_tokenizer(args.tokenizer_path, trust_remote_code=args.trust_remote_code)
    text = text_config(model.config)
    text.pad_token_id = model.config.pad_token_id = tok.pad_token_id
    if args.eos_token is not None:
        tok.eos_token = args.eos_token
        text.eos_token_id = model.config.eos_token_id = tok.eos_token_id
    if args.disable_dropout:
        disable_dropout(model)
    return RewardObjective(args.center_rewards_coefficient)


def packed(args) -> bool:
    return False


RECIPE = register(
    Recipe(
        name="reward",
        task="classify",
        args_class=RewardArgs,
        build_data=build_data,
        packed=packed,
        problems=problems,
        objective=objective,
        defaults=dict(output_dir="outputs/reward", learning_rate=1e-4, max_seq_length=1024),  # RewardConfig's
        demo=dict(
            max_steps=100,
            per_device_train_batch_size=16,
            per_device_eval_batch_size=50,
            learning_rate=3e-3,
            weight_decay=0.1,
            warmup_ratio=0.05,
            eval_steps=10,
            logging_steps=10,
            max_seq_length=160,  # the longest embedded pair has 145 tokens: none left out
        ),
    )
)
