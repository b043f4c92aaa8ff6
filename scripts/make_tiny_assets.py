"""Build the embedded tiny model config + tokenizer in hfpar/assets/tiny/ (offline, deterministic).

    python scripts/make_tiny_assets.py            # rewrites hfpar/assets/tiny/
    python scripts/make_tiny_assets.py --check    # exit 1 if the committed files differ from a fresh build

Tokenizer: character level (printable ASCII + tab + newline), a `tokenizers` BPE model with no merges,
so every character is one token; unknown characters map to <unk>. 128 ids in all (a multiple of 8, so
the vocab splits evenly for tensor parallelism):
    0 <pad>  1 <s> (bos)  2 </s> (eos, also ends every chat turn)  3 <unk>
    4 <|system|>  5 <|user|>  6 <|assistant|>  7 reserved
    8..104 the 97 characters  105..127 reserved (unreachable padding of the vocab)
`tokenizer("abc")` gives [<s>, a, b, c] (bos added, like Llama). The chat template renders
    <s><|user|>\\n{content}</s><|assistant|>\\n{content}</s>...
and `add_generation_prompt=True` appends `<|assistant|>\\n`.

Model: a LlamaConfig (hidden 128, 4 layers, 4 heads, 2 kv heads, intermediate 256, no tied
embeddings, use_cache false), ~0.6M parameters; weights are initialised by the recipes with `from_config`.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "hfpar" / "assets" / "tiny"
VOCAB_SIZE = 128
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|reserved_special|>"]
CHARS = ["\t", "\n"] + [chr(c) for c in range(32, 127)]  # 97 characters

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('hfpar-tiny chat template: role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"<|reserved_{i}|>"] = i
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        dtype="float32",
        # transformers only detects packed rows (position_ids restarting at 0) when no KV cache is built;
        # use_cache=False makes a plain model(input_ids=..., position_ids=...) call safe for packing.
        use_cache=False,
    )


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    build_config(tokenizer).save_pretrained(out)
    # The generic class name, which transformers 4.x and 5.x both resolve (5.x saves "TokenizersBackend").
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare a fresh build with the committed files")
    a = ap.parse_args()
    if not a.check:
        write(ASSETS)
        print(f"wrote {sorted(p.name for p in ASSETS.iterdir())} to {ASSETS}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp))
        names = sorted(p.name for p in Path(tmp).iterdir())
        _, bad, missing = filecmp.cmpfiles(ASSETS, tmp, names, shallow=False)
        if bad or missing:
            print(f"hfpar/assets/tiny is stale: differs {bad}, missing {missing}; rerun scripts/make_tiny_assets.py")
            return 1
    print("hfpar/assets/tiny is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
