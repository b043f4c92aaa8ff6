"""sft: supervised fine-tuning of a causal LM on TRL-style data (messages | prompt/completion | text), loss on the
assistant / completion tokens (--completion_only_loss), --packing packs samples into rows.

    from hfpar.recipe import main; main("sft")      # what recipes/sft.py runs
"""

from __future__ import annotations

from hfpar import data
from hfpar.recipes import Recipe, RecipeData, register
from hfpar.recipes._text import text_data


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    def tokenize(ds):
        ds, stats = data.cached(
            data.tokenize_sft,
            ds,
            tokenizer,
            args.max_seq_length,
            completion_only_loss=args.completion_only_loss,
            truncation=args.truncation,
        )
        return (data.pack(ds, args.max_seq_length) if args.packing else ds), stats, None

    return text_data(args, "sft", tokenizer, ctx, plan, tokenize)


RECIPE = register(
    Recipe(
        name="sft",
        task="lm",
        build_data=build_data,
        defaults=dict(
            output_dir="outputs/sft",
            max_steps=150,
            per_device_train_batch_size=16,
            learning_rate=1e-3,
            warmup_ratio=0.05,
            eval_steps=50,
            logging_steps=25,
            max_seq_length=128,
        ),
    )
)
