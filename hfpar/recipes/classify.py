"""classify: sequence classification (text + label), the model's classification head on its last real token.

from hfpar.recipe import main; main("classify")      # what recipes/classify.py runs
"""

from __future__ import annotations

from hfpar import data
from hfpar.recipes import Recipe, RecipeData, register
from hfpar.recipes._text import text_data


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    def tokenize(ds):
        return data.cached(data.tokenize_classify, ds, tokenizer, args.max_seq_length, truncation=args.truncation)

    return text_data(args, "classify", tokenizer, ctx, plan, tokenize)


RECIPE = register(
    Recipe(
        name="classify",
        task="classify",
        build_data=build_data,
        defaults=dict(output_dir="outputs/classify", learning_rate=5e-5),  # TrainingArguments' (run_glue: 128 tokens)
        demo=dict(
            max_steps=150,
            per_device_train_batch_size=32,
            learning_rate=2e-3,
            warmup_ratio=0.05,
            eval_steps=50,
            logging_steps=25,
            max_seq_length=64,
        ),
    )
)
