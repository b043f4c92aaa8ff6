"""Build the embedded tiny vision-language model's config + processor in hfpar/assets/tiny_vlm/ (offline,
deterministic), and the same for tests in any directory.

    python scripts/make_tiny_vlm.py                         # rewrites hfpar/assets/tiny_vlm/
    from scripts.make_tiny_vlm import write_vlm; write_vlm(path, "llava", weights=True)   # a test model of a family

An Idefics3 (SmolVLM's architecture) or LLaVA model: the embedded tiny Llama's language model (hidden 128, 4 layers,
its 128-id character tokenizer) with three of its reserved ids made the image tokens, and a 2-layer vision tower on
32 x 32 images in 8 x 8 patches:
  idefics3  <fake_token_around_image><global-img><image> x 4<fake_token_around_image> per image (16 patches, the
            connector's pixel shuffle by 2: 4 tokens), no image splitting; 1-D position ids
  llava     <image> x 17 per image (16 patches + the CLS token, CLIP's), a 2-layer MLP projector
The chat template is the tiny one, with {"type": "image"} parts rendered as <image>.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "hfpar" / "assets" / "tiny"
OUT = ROOT / "hfpar" / "assets" / "tiny_vlm"
IMAGE_TOKENS = {"<|reserved_105|>": "<image>", "<|reserved_106|>": "<fake_token_around_image>"}
IMAGE_TOKENS["<|reserved_107|>"] = "<global-img>"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
VISION.update(image_size=32, patch_size=8)


def tokenizer(tmp: Path):
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((TINY / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for old, new in IMAGE_TOKENS.items():
        vocab[new] = vocab.pop(old)
        spec["added_tokens"].append(
            {"id": vocab[new], "content": new, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
        )
    (tmp / "tokenizer.json").write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tmp / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
    )


def build(family: str):
    """(config, processor) of a tiny model of `family` (idefics3 | llava)."""
    from transformers import (
        AutoConfig,
        CLIPImageProcessor,
        Idefics3Config,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlavaConfig,
        LlavaProcessor,
    )

    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer(Path(tmp))
    text = AutoConfig.from_pretrained(TINY).to_dict()
    image_id = tok.convert_tokens_to_ids("<image>")
    if family == "idefics3":
        size = {"longest_edge": VISION["image_size"]}
        proc = Idefics3Processor(
            image_processor=Idefics3ImageProcessor(do_image_splitting=False, size=size, max_image_size=size),
            tokenizer=tok,
            chat_template=TEMPLATE,
            image_seq_len=4,
        )
        cfg = Idefics3Config(text_config=text, vision_config=VISION, image_token_id=image_id, scale_factor=2)
    elif family == "llava":
        side = VISION["image_size"]
        ip = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        proc = LlavaProcessor(
            image_processor=ip,
            tokenizer=tok,
            chat_template=TEMPLATE,
            patch_size=VISION["patch_size"],
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            image_token="<image>",
        )
        vision = {"model_type": "clip_vision_model", **VISION}
        cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_id=image_id, vision_feature_layer=-1)
    else:
        raise ValueError(f"family {family!r}: idefics3 or llava")
    cfg.use_cache = False
    cfg.text_config.use_cache = False
    cfg.tie_word_embeddings = False
    return cfg, proc


def write_vlm(path: str | Path, family: str = "idefics3", weights: bool = False, seed: int = 0) -> str:
    """A model directory of `family`: config and processor; weights: a random init from `seed` too (fp32)."""
    import torch
    from transformers import AutoModelForImageTextToText

    cfg, proc = build(family)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    proc.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    print(write_vlm(sys.argv[1] if len(sys.argv) > 1 else OUT))
