"""Image + text SFT data (hfpar.data.vision, hfpar.data.images, hfpar.recipes._vision) on the embedded tiny VLM's
processor (hfpar/assets/tiny_vlm, Idefics3): labels (the answer only; image tokens never targets, also with the
loss on every token), TRL's formats (messages with string or typed contents, conversational prompt / completion, an
`images` or `image` column of PIL images, paths or bytes), the collated batch, and every bad input refused in one
line naming the example before the model loads: an image that cannot be opened, a path outside the dataset's
directory, more image references than images, a model without an image processor, image rows for a text model,
CP and PP on a VLM, --packing on a VLM.
"""

from __future__ import annotations

import io
import types

import pytest
from transformers import AutoConfig

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar import data
from hfpar import preflight as pf
from hfpar.context import ParallelContext
from hfpar.data.shapes import make_shapes
from hfpar.data.vision import VisionCollator, is_image_text, load_processor, tokenize_vision
from hfpar.recipes import sft
from hfpar.recipes._vision import text_rows_problem
from tests.helpers.preflight import _args

VLM = data.embedded_model_path(data.EMBEDDED_VLM)


@pytest.fixture(scope="module")
def proc():
    return load_processor(VLM, "idefics3", 0)


@pytest.fixture(scope="module")
def rows():
    return make_shapes(seed=3, n_train=4, n_eval=1)["train"]


def _image_ids(proc) -> set[int]:
    tok = proc.tokenizer
    return {tok.convert_tokens_to_ids(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>")}


def test_labels_are_the_answer_and_never_an_image_token(proc, rows):
    ds, stats = tokenize_vision(rows, proc, 128)
    tok = proc.tokenizer
    for row, sample in zip(rows, ds.rows):
        targets = [t for t in sample["labels"] if t != -100]
        assert tok.decode(targets) == row["messages"][1]["content"] + tok.eos_token
        assert _image_ids(proc) & set(sample["input_ids"]) == _image_ids(proc)  # 4 image tokens + the markers
    full, _ = tokenize_vision(rows, proc, 128, completion_only_loss=False)
    for sample in full.rows:
        labelled = {t for t in sample["labels"] if t != -100}
        assert not labelled & _image_ids(proc) and tok.convert_tokens_to_ids("W") in labelled  # the question too
    assert stats["images"] == 4 and stats["dropped"] == 0


def test_trl_formats_give_the_same_rows(proc, rows, tmp_path):
    row = rows[0]
    buf = io.BytesIO()
    row["images"][0].save(buf, format="PNG")
    row["images"][0].save(tmp_path / "a.png")
    user, answer = row["messages"]
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user["content"]}]}, answer]
    variants = [
        row,
        {"image": buf.getvalue(), "messages": typed},  # bytes, typed contents
        {"images": ["a.png"], "prompt": [user], "completion": [answer]},  # a path in the dataset's directory
    ]
    (want, *others), _ = tokenize_vision(variants, proc, 128, root=tmp_path)
    assert all(o["input_ids"] == want["input_ids"] and o["labels"] == want["labels"] for o in others)


def test_collated_batch_carries_the_pixels(proc, rows):
    ds, _ = tokenize_vision(rows, proc, 128)
    batch = VisionCollator(proc, pad_to_multiple_of=8)([ds[i] for i in range(3)])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[1] % 8 == 0
    assert tuple(batch["pixel_values"].shape) == (3, 1, 3, 32, 32) and "pixel_attention_mask" in batch


def _refusal(rows, proc, root=None) -> str:
    with pytest.raises(data.DataError) as exc:
        tokenize_vision(rows, proc, 128, root=root)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_bad_images_are_refused_naming_the_example(proc, rows, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path.parent / "outside.png").write_bytes(b"x")
    msgs = rows[0]["messages"]
    why = _refusal([rows[0], {"images": ["bad.png"], "messages": msgs}], proc, tmp_path)
    assert why.startswith("example 1: image 0 ('bad.png') cannot be opened: UnidentifiedImageError"), why
    why = _refusal([{"images": ["../outside.png"], "messages": msgs}], proc, tmp_path)
    assert why.startswith("example 0: image 0 path '../outside.png' lies outside the dataset's directory"), why
    why = _refusal([{"images": ["a.png"], "messages": msgs}], proc, None)
    assert "was not read from a local directory" in why, why
    assert "cannot be opened" in _refusal([{"images": [b"\x89PNG broken"], "messages": msgs}], proc)


def test_more_image_references_than_images(proc, rows):
    two = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is red?"}]
    row = {"images": rows[0]["images"], "messages": [{"role": "user", "content": two}, rows[0]["messages"][1]]}
    why = _refusal([rows[1], row], proc)
    assert why.startswith("example 1: the messages refer to 2 image(s) and the row has 1; give one image per"), why


def test_a_model_without_an_image_processor(rows):
    with pytest.raises(data.DataError) as exc:
        load_processor(data.embedded_model_path(), "idefics3", 0)  # a tokenizer only
    why = str(exc.value)
    assert why.startswith("example 0 has images, but --model_name_or_path ") and "has no image processor" in why, why


def test_image_rows_for_a_text_model():
    from datasets import Dataset

    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}], "images": []}] * 2)
    args = types.SimpleNamespace(dataset_name="d.jsonl", model_name_or_path="hfpar-tiny")
    plan = types.SimpleNamespace(model_type="llama")
    assert text_rows_problem(args, plan, ds) is None  # an empty images column is a text dataset
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}], "images": ["a.png"] * n} for n in (0, 1)])
    why = text_rows_problem(args, plan, ds)
    assert why.startswith("dataset d.jsonl: example 1 has images, but --model_name_or_path hfpar-tiny "), why


def test_parallel_layouts_on_a_vlm_refused_in_one_line():
    cfg = AutoConfig.from_pretrained(VLM)
    assert is_image_text(cfg) and not is_image_text(AutoConfig.from_pretrained(data.embedded_model_path()))
    (cp,) = pf.model_problems(_args("--cp_size", "2"), ParallelContext(world=2, cp=2), "lm", cfg, image_text=True)
    assert cp.startswith("--cp_size 2: model_type 'idefics3' is a vision-language model, whose rows hold image"), cp
    gemma3 = _args("--cp_size", "2", "--cp_mode", "ring")  # AutoModelForCausalLM builds it: text rows may use CP
    assert pf.model_problems(gemma3, ParallelContext(world=2, cp=2), "lm", tiny_config("gemma3"), image_text=True) == []
    (pp,) = pf.model_problems(_args("--pp_size", "2"), ParallelContext(world=2, pp=2), "lm", cfg, image_text=True)
    assert pp.startswith("--pp_size 2: model_type 'idefics3'") and "valid: pp_size 1" in pp and "\n" not in pp, pp
    # an image-text-only type: refused by a text recipe, trained by sft (AutoModelForImageTextToText)
    assert "has no causal-LM class" in pf.model_problems(_args(), ParallelContext(world=1), "lm", cfg)[0]
    assert pf.model_problems(_args("--tp_size", "2"), ParallelContext(world=2, tp=2), "lm", cfg, image_text=True) == []
    plan = types.SimpleNamespace(image_text=True, model_type="idefics3")
    (packing,) = sft.problems(types.SimpleNamespace(packing=True), None, plan)
    assert packing.startswith("--packing with model_type 'idefics3', a vision-language model")
    assert data.padding_free_mode(_args(), "lm", cfg, packed=False) == (True, None)  # its Llama text model checked
    on, why = data.padding_free_mode(_args(), "lm", tiny_config("qwen2_vl"), packed=False)
    assert not on and why.startswith("model_type 'qwen2_vl' is a vision-language model not among those verified")


def test_fsdp2_wrapper_class_keeps_the_checkpoint_renames(tmp_path):
    """transformers saves LLaVA under its legacy names (language_model.model.*) and renames them by the model's
    class on load; FSDP2's subclass (FSDPLlavaForConditionalGeneration) must find the same renames."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForImageTextToText

    from hfpar.loading.files import checkpoint_index
    from hfpar.loading.sharded import _Sources
    from scripts.make_tiny_vlm import write_vlm

    path = write_vlm(tmp_path / "llava", "llava", weights=True)
    model = AutoModelForImageTextToText.from_pretrained(path)
    cls = type(model)
    model.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})  # as fully_shard builds it
    sources = _Sources(model, checkpoint_index(path))
    assert all(sources.has(n) for n in model.state_dict()) and type(model).__name__.startswith("FSDP")


def test_json_rows_keep_their_types_across_files(tmp_path):
    """`datasets` would read the typed contents of train.jsonl as JSON strings (eval.jsonl's are strings)."""
    import json

    from hfpar.recipes._vision import json_rows

    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}]
    plain = [{"role": "user", "content": "Which?"}]
    (tmp_path / "train.jsonl").write_text(json.dumps({"images": ["a.png"], "messages": typed}) + "\n")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"images": ["a.png"], "messages": plain}) + "\n")
    rows = json_rows(tmp_path, 0.05, 42)
    assert rows["train"][0]["messages"] == typed and rows["eval"][0]["messages"] == plain
    one = tmp_path / "one"
    one.mkdir()
    (one / "rows.jsonl").write_text("".join(json.dumps({"messages": plain, "n": i}) + "\n" for i in range(40)))
    rows = json_rows(one, 0.05, 42)  # no eval file: 2 of 40 rows carved, as load_splits carves
    assert len(rows["train"]) == 38 and len(rows["eval"]) == 2
    assert sorted(r["n"] for r in rows["train"] + rows["eval"]) == list(range(40))


def test_cp_with_image_rows_refused_by_the_data(tmp_path):
    """A VLM that AutoModelForCausalLM also builds (Gemma-3) passes the preflight with --cp_size; its image rows are
    refused when the data is read, before the model loads."""
    from hfpar.recipes._vision import vision_data

    args = types.SimpleNamespace(dataset_name=None, seed=0)
    with pytest.raises(data.DataError) as exc:
        vision_data(args, ParallelContext(world=2, cp=2), types.SimpleNamespace(model_type="gemma3"))
    assert str(exc.value).startswith("example 0 has images: --cp_size 2: model_type 'gemma3' is a vision-language")


@pytest.mark.parametrize("family", ["idefics3", "llava"])
def test_a_batch_mixing_image_and_text_rows_runs(family, rows):
    """Rows without images beside rows with them (the image processor gets the rows that have some)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from scripts.make_tiny_vlm import build

    cfg, proc = build(family)
    text_only = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    ds, stats = tokenize_vision([rows[0], text_only, rows[1]], proc, 128)
    assert stats["images"] == 2
    batch = VisionCollator(proc)([ds[i] for i in range(3)])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = model(**inputs, labels=batch["labels"], use_cache=False).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("family", ["idefics3", "llava"])
def test_padding_free_image_rows_give_each_row_its_own_logits(family):
    """Packed image rows (position ids restarting per row, the images in the order of their tokens): every row's
    logits equal its logits alone, float64, sdpa (hfpar.data.padding_free.VLM_FAMILIES)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from scripts.make_tiny_vlm import build

    cfg, proc = build(family)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa").double().eval()
    rows = make_shapes(seed=5, n_train=6, n_eval=1)["train"]
    rows.insert(2, {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]})
    ds, _ = tokenize_vision(rows, proc, 128)
    feats = [ds[i] for i in range(len(ds))]
    free = VisionCollator(proc, padding_free=True, max_seq_length=128)(feats)
    assert free["input_ids"].shape[0] < len(feats) and "attention_mask" not in free  # packed: fewer rows

    def logits(batch):
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        return model(**{k: v for k, v in inputs.items() if k not in ("labels", "token_mask")}, use_cache=False).logits

    with torch.no_grad():
        packed = logits(free)
        for f in feats:  # rows with the same text (another image) may match too: the closest is the row itself
            alone, n, diffs = logits(VisionCollator(proc)([f]))[0], len(f["input_ids"]), []
            for r, pos in enumerate(free["position_ids"].tolist()):
                for s in (j for j, p in enumerate(pos) if p == 0):
                    if free["input_ids"][r, s : s + n].tolist() == f["input_ids"]:
                        diffs.append(float((packed[r, s : s + n] - alone).abs().max()))
            assert diffs and min(diffs) < 1e-10, (family, diffs)
