"""The data of the sft recipe for a vision-language model (plan.image_text): image + text rows through the model's
processor (hfpar.data.vision), or with no --dataset_name the embedded shapes task (hfpar.data.shapes).

    return vision_data(args, ctx, plan)      # RecipeData(train, eval, VisionCollator, info, processor=processor)
"""

from __future__ import annotations

from pathlib import Path

from hfpar import data
from hfpar.data.images import row_images
from hfpar.data.shapes import make_shapes
from hfpar.data.vision import VisionCollator, has_images, load_processor, tokenize_vision
from hfpar.recipes import RecipeData

SHAPES = "hfpar-shapes"  # stats["dataset"] of the embedded task


def _rows(args) -> tuple[dict[str, list[dict]], Path | None]:
    """{train, eval} rows as dicts, and the directory image paths resolve in (None: no local directory)."""
    if args.dataset_name is None:
        return make_shapes(args.seed), None
    splits = data.load_splits(args.dataset_name, "sft", eval_split_fraction=args.eval_split_fraction, seed=args.seed)
    path = Path(args.dataset_name).expanduser()
    root = path if path.is_dir() else path.parent if path.is_file() else None
    # to_list: datasets' Image columns stay undecoded ({bytes, path}); hfpar.data.images opens them
    return {k: v.to_list() for k, v in splits.items()}, root


def cp_refusal(ctx, rows: list[dict], first: int | None) -> str | None:
    """Context parallelism with image rows, refused in one line (an image's tokens would be split across ranks)."""
    if ctx.cp == 1 or first is None:
        return None
    return (
        f"--cp_size {ctx.cp} with image rows (example {first} has {len(row_images(rows[first], first))} image(s)): "
        "context parallelism splits each row's tokens across ranks, which parts an image's tokens from the features "
        "the vision tower computes for all of them; valid: cp_size 1 (DDP, FSDP2, ZeRO and --tp_size apply)"
    )


def vision_data(args, ctx, plan) -> RecipeData:
    splits, root = _rows(args)
    first = has_images(splits["train"])
    if why := cp_refusal(ctx, splits["train"], first):
        raise data.DataError(why)
    path = data.embedded_model_path(args.tokenizer_path) if args.tokenizer_path in data.EMBEDDED_MODELS else None
    processor = load_processor(path or args.tokenizer_path, plan.model_type, first, args.trust_remote_code)
    info, out = {}, {}
    for name in ("train", "eval"):
        ds, stats = tokenize_vision(
            splits[name],
            processor,
            args.max_seq_length,
            root=root,
            completion_only_loss=args.completion_only_loss,
            truncation=args.truncation,
        )
        out[name] = ds
        info[f"{name}_data"] = {**stats, "rows": len(ds), **({"dataset": SHAPES} if args.dataset_name is None else {})}
    seq_multiple = ctx.seq_multiple
    collator = VisionCollator(processor, pad_to_multiple_of=seq_multiple if seq_multiple > 1 else None)
    return RecipeData(out["train"], out["eval"], collator, info, processor=processor)


def text_rows_problem(args, plan, ds) -> str | None:
    """Image rows given to a text model, in one line naming the example (None: no image rows)."""
    if not {"images", "image"} & set(ds.column_names):
        return None
    first = has_images(ds.select_columns([c for c in ("images", "image") if c in ds.column_names]).to_list())
    if first is None:
        return None
    return (
        f"dataset {args.dataset_name}: example {first} has images, but --model_name_or_path {args.model_name_or_path} "
        f"(model_type {plan.model_type!r}) is no vision-language model (no vision_config; "
        "AutoModelForImageTextToText does not build it): use one, or drop the images column"
    )
