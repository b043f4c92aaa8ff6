"""sft: supervised fine-tuning of a causal LM on TRL-style data (messages | prompt/completion | text), loss on the
assistant / completion tokens (--completion_only_loss), --packing packs samples into rows. A vision-language model
(its config has a vision tower: plan.image_text) trains on image + text rows through its processor instead
(hfpar.recipes._vision; `--model_name_or_path hfpar-tiny-vlm`: the embedded tiny VLM on generated shapes).

    from hfpar.recipe import main; main("sft")      # what recipes/sft.py runs
"""

from __future__ import annotations

from hfpar import data
from hfpar.recipes import Recipe, RecipeData, register
from hfpar.recipes._text import text_data
from hfpar.recipes._vision import text_rows_problem, vision_data


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    if plan.image_text:  # the processor renders, tokenizes and expands the images
        return vision_data(args, ctx, plan)

    def tokenize(ds):
        if why := text_rows_problem(args, plan, ds):
            raise data.DataError(why)
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


def problems(args, ctx, plan) -> list[str]:
    if plan.image_text and args.packing:
        return [
            f"--packing with model_type {plan.model_type!r}, a vision-language model: its image rows keep their image "
            "tokens where the processor put them, one row each (padded batches); drop --packing"
        ]
    return []


RECIPE = register(
    Recipe(
        name="sft",
        task="lm",
        build_data=build_data,
        one_row=True,  # hfpar.recipes._text: DataCollator(one_row=plan.one_row)
        problems=problems,
        image_text=True,
        defaults=dict(output_dir="outputs/sft", learning_rate=2e-5, max_seq_length=1024),  # TRL SFTConfig's
        demo=dict(
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
