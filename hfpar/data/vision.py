"""Image + text SFT data, TRL 1.16's formats: conversational `messages` (or prompt / completion) whose content parts
include images, and an `images` (or `image`) column; the model's processor renders and tokenizes them.

    processor = load_processor(model_dir, config, rows)            # DataError (one line) if it has no image processor
    train, stats = tokenize_vision(rows, processor, 128, root=Path("my_data"))   # every image opened once, here
    collate = VisionCollator(processor)
    batch = collate([train[i] for i in range(4)])   # input_ids, attention_mask, labels + pixel_values (and the
                                                    # processor's other image inputs: pixel_attention_mask, ...)

Messages with string contents get TRL's placeholders (`prepare_multimodal_messages`: one {"type": "image"} part per
image, before the first user message's text); the placeholders of a row must match its images. Labels as the text
recipe's (hfpar.data.tokenize): the assistant turns (prompt / completion: the completion) with --completion_only_loss,
else every token; the tokens the processor expands an image into (and the placeholder itself) are never targets.
The mask is found on the text before the expansion (character spans, hfpar.data.chat) and carried over to the
processor's token ids by aligning the two sequences, which differ only where images expanded.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from .chat import _render_chat
from .collate import DataCollator, first_fit_decreasing, join_samples
from .errors import DataError, _one_line
from .images import check_image, open_image, row_images
from .tokenize import IGNORE, _check_args, _tokenize_spans

TEXT_KEYS = ("input_ids", "attention_mask")


def is_image_text(config) -> bool:
    """Whether the model is a vision-language model: its config has a vision tower (vision_config), or
    AutoModelForImageTextToText builds its type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    return config is not None and (
        getattr(config, "vision_config", None) is not None
        or getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def image_cp_refusal(cp: int, model_type: str | None) -> str:
    """Context parallelism on a vision-language model's image rows, refused in one line (the preflight's)."""
    return (
        f"--cp_size {cp}: model_type {model_type!r} is a vision-language model, whose rows hold image tokens: context "
        "parallelism would split them across ranks, apart from the features the vision tower computes for all of "
        "them; valid: cp_size 1 (DDP, FSDP2, ZeRO and --tp_size apply)"
    )


def has_images(rows) -> int | None:
    """The index of the first row with an image (None: a text dataset)."""
    return next((i for i, r in enumerate(rows) if row_images(r, i)), None)


def load_processor(path: str, model_type: str | None, first_image_row: int | None, trust_remote_code: bool = False):
    """The model's AutoProcessor, which must hold an image processor and a tokenizer with a pad token."""
    from transformers import AutoProcessor  # noqa: PLC0415

    try:
        proc = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001  (an untrusted directory: one line)
        raise DataError(f"{path}: its processor cannot be loaded: {type(exc).__name__}: {_one_line(exc)}") from None
    if getattr(proc, "image_processor", None) is None or getattr(proc, "tokenizer", None) is None:
        where = f"example {first_image_row} has images, but " if first_image_row is not None else ""
        raise DataError(
            f"{where}--model_name_or_path {path} (model_type {model_type!r}) has no image processor: AutoProcessor "
            f"gives a {type(proc).__name__}; save the model's processor (processor_config.json, "
            "preprocessor_config.json) beside it"
        )
    tok = proc.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return proc


def prepare_messages(messages, n_images: int, index: int) -> list[dict]:
    """TRL's prepare_multimodal_messages: contents as lists of parts, image placeholders inserted before the first
    user message's text when contents are strings; the row's images must match the placeholders."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"example {index}: messages is not a non-empty list of {{role, content}}")
    out, placed = [], False
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DataError(f"example {index}: message {k} needs a role of system, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if m["role"] == "user" and not placed:
                parts = [{"type": "image"} for _ in range(n_images)] + parts
                placed = True
            m = {**m, "content": parts}
        elif not isinstance(content, list) or not all(isinstance(p, dict) and "type" in p for p in content):
            raise DataError(f"example {index}: message {k}'s content is neither a string nor a list of typed parts")
        out.append(m)
    refs = sum(p["type"] == "image" and "image" not in p for m in out for p in m["content"])
    if refs != n_images:
        raise DataError(
            f"example {index}: the messages refer to {refs} image(s) and the row has {n_images}; give one image per "
            "{'type': 'image'} part"
        )
    return out


class _Rendering:
    """What hfpar.data.chat renders with: the processor's chat template, the tokenizer's eos."""

    def __init__(self, processor):
        self.proc, self.eos_token = processor, processor.tokenizer.eos_token

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        return self.proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)


def _chat_of(row: dict, n_images: int, index: int) -> tuple[list[dict], int]:
    """(messages, first trainable turn) of a messages or a conversational prompt / completion row."""
    if "messages" in row and row["messages"] is not None:
        return prepare_messages(row["messages"], n_images, index), 0
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        p = prepare_messages(prompt, n_images, index)
        return p + prepare_messages(completion, 0, index), len(p)
    raise DataError(
        f"example {index}: image rows need conversational data (messages, or prompt and completion lists of "
        f"{{role, content}}); found columns {sorted(row)}"
    )


def _align(plain: list[int], mask: list[bool], expanded: list[int], image_ids: set[int]) -> list[bool]:
    """The trainable mask over the processor's ids: a token is trained where it matches a trainable token of the
    text before the expansion and is no image token."""
    out = [False] * len(expanded)
    sm = difflib.SequenceMatcher(None, plain, expanded, autojunk=False)
    for a, b, n in sm.get_matching_blocks():
        for k in range(n):
            out[b + k] = mask[a + k] and expanded[b + k] not in image_ids
    return out


class VisionSamples:
    """Tokenized image rows: sample i = {input_ids, labels, <per-token keys>, images (RGB PIL, opened on access)}."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {**row, "images": [open_image(s) for s in row["images"]]}


def tokenize_vision(
    rows,
    processor,
    max_seq_length: int,
    *,
    root: Path | None = None,
    completion_only_loss: bool = True,
    truncation: str = "truncate",
) -> tuple[VisionSamples, dict]:
    """Image rows -> (VisionSamples, stats). Every image is opened here (a bad one: a DataError naming the example).
    A row longer than max_seq_length is cut (truncation "truncate") only where no image token is cut away, else
    left out and counted as dropped."""
    _check_args(max_seq_length, truncation)
    tok = processor.tokenizer
    image_ids = {i for i in (getattr(processor, "image_token_id", None),) if i is not None}
    render = _Rendering(processor)
    stats = {"examples": len(rows), "truncated": 0, "dropped": 0, "no_targets": 0, "cut_away": 0, "tokens": 0}
    stats.update(target_tokens=0, images=0)
    out = []
    for index, row in enumerate(rows):
        srcs = [check_image(s, index, j, root) for j, s in enumerate(row_images(row, index))]
        messages, first = _chat_of(row, len(srcs), index)
        text, spans = _render_chat(render, messages, first, index)
        images = [open_image(s) for s in srcs]
        try:
            enc = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001  (the processor's own checks, e.g. image tokens vs images)
            raise DataError(f"example {index}: the processor failed: {type(exc).__name__}: {_one_line(exc)}") from None
        ids = list(enc["input_ids"][0])
        [(plain, mask)] = _tokenize_spans(tok, [text], [spans], False)
        mask = _align(plain, [m or not completion_only_loss for m in mask], ids, image_ids)
        extra = {k: list(v[0]) for k, v in enc.items() if k not in TEXT_KEYS and _per_token(v, len(ids))}
        if len(ids) > max_seq_length:
            if truncation == "drop" or any(t in image_ids for t in ids[max_seq_length:]):
                stats["dropped"] += 1
                continue
            ids, mask = ids[:max_seq_length], mask[:max_seq_length]
            extra = {k: v[:max_seq_length] for k, v in extra.items()}
            stats["truncated"] += 1
        n_targets = sum(mask[1:])
        if n_targets == 0:
            stats["no_targets"] += 1
            continue
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        out.append({"input_ids": ids, "labels": labels, **extra, "images": srcs})
        stats["tokens"] += len(ids)
        stats["target_tokens"] += n_targets
        stats["images"] += len(srcs)
    if not out:
        raise DataError(f"no image + text example left with max_seq_length {max_seq_length} ({stats})")
    return VisionSamples(out), stats


def _text_part(f: dict) -> dict:
    return {k: f[k] for k in ("input_ids", "labels", "position_ids") if k in f}


def _packed(features: list[dict], max_seq_length: int) -> list[dict]:
    """Rows of packed samples (join_samples' layout), each with the images of its samples in order."""
    rows = []
    for b in first_fit_decreasing([len(f["input_ids"]) for f in features], max_seq_length):
        row = join_samples([(features[i]["input_ids"], features[i]["labels"]) for i in b])
        for k in features[b[0]]:
            if k not in ("input_ids", "labels", "images"):  # per-token inputs, concatenated as the tokens are
                row[k] = [t for i in b for t in features[i][k]]
        rows.append({**row, "images": [img for i in b for img in features[i]["images"]]})
    return rows


def _per_token(v, n: int) -> bool:
    try:
        return len(v) == 1 and len(v[0]) == n and not isinstance(v[0][0], (list, torch.Tensor))
    except TypeError:
        return False


class VisionCollator:
    """Samples of VisionSamples -> the text batch (hfpar.data.DataCollator: padded rows) + the images of its rows
    through the processor's image processor (its model inputs: pixel_values, pixel_attention_mask, image_grid_thw).

    padding_free: the samples packed into rows of at most max_seq_length tokens first (first-fit decreasing, position
    ids restarting per sample: hfpar.data.collate), their images in the order of their image tokens in the rows (the
    model merges image features into the image tokens in that order); only for hfpar.data.padding_free.VLM_FAMILIES."""

    def __init__(
        self,
        processor,
        pad_to_multiple_of: int | None = None,
        padding_free: bool = False,
        max_seq_length: int | None = None,
    ):
        self.image_processor = processor.image_processor
        self.text = DataCollator(processor.tokenizer, pad_to_multiple_of=pad_to_multiple_of)
        self.keys = tuple(getattr(self.image_processor, "model_input_names", None) or ("pixel_values",))
        self.padding_free, self.max_seq_length = padding_free, max_seq_length

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if self.padding_free:
            features = _packed(features, self.max_seq_length)
        batch = self.text([_text_part(f) for f in features])
        length = batch["input_ids"].shape[1]
        for k in features[0]:
            if k not in ("input_ids", "labels", "images", "position_ids"):  # per-token inputs: padded with 0
                batch[k] = torch.zeros(len(features), length, dtype=torch.long)
                for r, f in enumerate(features):
                    batch[k][r, : len(f[k])] = torch.as_tensor(f[k])
        images = [f["images"] for f in features if f["images"]]
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            batch.update({k: v for k, v in out.items() if k in self.keys and torch.is_tensor(v)})
        return batch
