"""The data of the text recipes (sft, clm, classify): load the train / eval splits, tokenize each (cached), collate.

return text_data(args, "sft", tokenizer, ctx, plan, tokenize)   # tokenize(ds) -> (ds, stats, num_labels | None)
"""

from __future__ import annotations

from hfpar import data
from hfpar.recipes import RecipeData


def text_data(args, kind: str, tokenizer, ctx, plan, tokenize) -> RecipeData:
    """kind: the data format of hfpar.data.load_splits (sft | clm | classify)."""
    splits = data.load_splits(args.dataset_name, kind, eval_split_fraction=args.eval_split_fraction, seed=args.seed)
    info, out, num_labels = {}, {}, None
    for name in ("train", "eval"):
        ds, stats, num_labels = tokenize(splits[name])
        out[name] = ds
        info[f"{name}_data"] = {**stats, "rows": len(ds)}
    # context / sequence parallelism cut T: pad every batch to a multiple of what they need (ParallelContext)
    seq_multiple = ctx.seq_multiple
    collator = data.DataCollator(
        tokenizer,
        task=plan.task,
        pad_to_multiple_of=seq_multiple if seq_multiple > 1 else None,
        padding_free=plan.padding_free,
        one_row=plan.one_row,
        max_seq_length=args.max_seq_length,
    )
    return RecipeData(out["train"], out["eval"], collator, info, num_labels)
