"""The data of the sft recipe for a vision-language model (plan.image_text): image + text rows through the model's
processor (hfpar.data.vision), or with no --dataset_name the embedded shapes task (hfpar.data.shapes).

    return vision_data(args, ctx, plan)      # RecipeData(train, eval, VisionCollator, info, processor=processor)
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset

from hfpar import data
from hfpar.data.load import EVAL_NAMES, _builder_of, _carve_eval, _check_json, _dir_files, _is_json_lines
from hfpar.data.shapes import make_shapes
from hfpar.data.vision import VisionCollator, has_images, image_cp_refusal, load_processor, tokenize_vision
from hfpar.recipes import RecipeData

SHAPES = "hfpar-shapes"  # stats["dataset"] of the embedded task


def _rows(args) -> tuple[dict[str, list[dict]], Path | None]:
    """{train, eval} rows as dicts, and the directory image paths resolve in (None: no local directory)."""
    if args.dataset_name is None:
        return make_shapes(args.seed), None
    path = Path(args.dataset_name).expanduser()
    root = path if path.is_dir() else path.parent if path.is_file() else None
    if root is not None and (rows := json_rows(path, args.eval_split_fraction, args.seed)) is not None:
        return rows, root
    splits = data.load_splits(args.dataset_name, "sft", eval_split_fraction=args.eval_split_fraction, seed=args.seed)
    # rows as the dataset decodes them (Image columns as PIL images; to_list() would leave Json columns as strings)
    return {k: list(v) for k, v in splits.items()}, root


def json_rows(path: Path, eval_fraction: float, seed: int) -> dict[str, list[dict]] | None:
    """{train, eval} rows of a local JSON / JSON Lines dataset (files and splits found as load_splits finds them),
    each row as written: `datasets` gives one type to a column across a split's files, and turns message contents
    that are typed parts in one file and strings in another into JSON strings. None for other formats."""
    builder, files = _dir_files(path) if path.is_dir() else (_builder_of(path), {"train": [str(path)]})
    if builder != "json":
        return None
    out = {}
    for split, names in files.items():
        rows = []
        for name in names:
            _check_json(Path(name))  # malformed JSON: one line naming the file and line
            text = Path(name).read_text(encoding="utf-8")
            rows += (
                json.loads(text)
                if Path(name).suffix == ".json" and not _is_json_lines(text)
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
        out[split] = rows
    train = out.get("train", next(iter(out.values())))
    evals = next((out[s] for s in EVAL_NAMES if s in out and out[s] is not train), None)
    if not train:
        raise data.DataError(f"dataset {path}: the train split is empty")
    if evals is None:  # carved as load_splits carves (a seeded permutation)
        keep, held = _carve_eval(Dataset.from_dict({"i": list(range(len(train)))}), eval_fraction, seed, str(path))
        train, evals = [train[i] for i in keep["i"]], [train[i] for i in held["i"]]
    return {"train": train, "eval": evals}


def vision_data(args, ctx, plan) -> RecipeData:
    splits, root = _rows(args)
    first = has_images(splits["train"])
    if ctx.cp > 1 and first is not None:  # (a VLM only AutoModelForImageTextToText builds: refused by the preflight)
        raise data.DataError(f"example {first} has images: {image_cp_refusal(ctx.cp, plan.model_type)}")
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
    collator = VisionCollator(
        processor,
        pad_to_multiple_of=seq_multiple if seq_multiple > 1 else None,
        padding_free=plan.padding_free,
        max_seq_length=args.max_seq_length,
    )
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
