"""clm: causal-LM pretraining on plain text, documents packed into rows (position ids restart per document).

from hfpar.recipe import main; main("clm")      # what recipes/clm.py runs
"""

from __future__ import annotations

from hfpar import data
from hfpar.recipes import Recipe, RecipeData, register
from hfpar.recipes._text import text_data


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    def tokenize(ds):
        ds, stats = data.cached(data.tokenize_clm, ds, tokenizer, args.max_seq_length)
        return ds, stats, None

    return text_data(args, "clm", tokenizer, ctx, plan, tokenize)


def packed(args) -> bool:
    return True  # rows are packed documents by construction


RECIPE = register(
    Recipe(
        name="clm",
        task="lm",
        build_data=build_data,
        one_row=True,  # hfpar.recipes._text: DataCollator(one_row=plan.one_row)
        packed=packed,
        # TrainingArguments' learning rate; run_clm.py's block size (min(1024, the model's))
        defaults=dict(output_dir="outputs/clm", learning_rate=5e-5, max_seq_length=1024),
        demo=dict(
            max_steps=150,
            per_device_train_batch_size=16,
            learning_rate=3e-3,
            warmup_ratio=0.05,
            eval_steps=50,
            logging_steps=25,
            max_seq_length=128,
        ),
    )
)
