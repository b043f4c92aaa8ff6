"""Data for every recipe: load -> format -> tokenize -> (pack) -> collate.

    from hfpar import data
    tok = data.load_tokenizer(None)                              # the embedded char-level tokenizer
    splits = data.load_splits(None, "sft")                       # DatasetDict(train, eval), generated
    train, stats = data.tokenize_sft(splits["train"], tok, 128)  # input_ids, labels (-100 = no loss)
    collate = data.DataCollator(tok, padding_free=True, max_seq_length=128)  # each batch's samples packed into rows
    batch = collate([train[i] for i in range(8)])                # (or data.DataCollator(tok): padded rows)
    logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "token_mask")}, use_cache=False).logits
    train = data.pack(train, 128)                                # the whole dataset packed, + position_ids

    load.py      the tokenizer; DatasetDict(train, eval) from the embedded generator, local files or the hub
    chat.py      chat-template rendering and the character spans of the assistant replies
    tokenize.py  tokenize_sft / tokenize_clm / tokenize_classify
    cache.py     cached(tokenize_*, ds, tok, ...): tokenized splits kept on disk, keyed like datasets' own cache
    collate.py   pack, pack_batch, DataCollator;  errors.py  DataError
    padding_free.py  padding_free_mode: whether padding-free batches apply to a run (task, model family, ...)
    prompts.py   load_prompts -> PromptSet (GRPO's prompt-only data, TRL's formats), left_pad (import it from there);
    grpo_task.py the embedded GRPO task; GRPO_START / grpo_start_path(): its warm-start model (hfpar/assets/grpo_start)
    vision.py    image + text SFT rows through a vision-language model's processor (tokenize_vision, VisionCollator);
    images.py    their images (PIL, bytes, paths inside the dataset's directory);  shapes.py  the embedded VLM task

Labels are NOT shifted: the target of position t is labels[t + 1] (the trainer shifts).

Packed rows (from `pack` or `tokenize_clm`) carry `position_ids` that restart at 0 at every sample;
the collator then returns position_ids, token_mask (real tokens; not a model input) and NO attention_mask.
DataCollator(padding_free=True) packs the samples of each batch that way (same samples, same targets).
transformers 5 detects packing from the position ids only when attention_mask is None AND no KV cache
is built, so call the model with `use_cache=False` (the embedded config also sets use_cache false). It
then builds a block-diagonal causal mask (eager, sdpa) or uses varlen kernels (flash attention):
tests/unit/test_data.py and tests/unit/test_padding_free.py check that a packed row gives the same logits as its
samples run one by one.

Every user mistake raises `DataError` (a ValueError) with a one-line message naming the value.
The embedded datasets live in hfpar/data/synthetic.py.
"""

from importlib import resources

from hfpar.parallel.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".cache": ("cached",),
        ".chat": ("_render_chat",),
        ".collate": (
            "DataCollator",
            "pack",
            "pack_batch",
        ),
        ".errors": ("DataError",),
        ".load": (
            "BUILDERS",
            "EMBEDDED",
            "EMBEDDED_MODELS",
            "EMBEDDED_VLM",
            "EVAL_NAMES",
            "FILE_LIKE",
            "FORMATS",
            "KINDS",
            "embedded_model_path",
            "label_names_of",
            "load_splits",
            "load_tokenizer",
        ),
        ".padding_free": (
            "one_row",
            "padding_free_mode",
        ),
        ".tokenize": (
            "IGNORE",
            "_tokenize_spans",
            "tokenize_classify",
            "tokenize_clm",
            "tokenize_sft",
        ),
    },
)

# The GRPO warm start: the embedded tiny model after a short SFT on the embedded GRPO task (hfpar/data/grpo_task.py),
# a normal HF model directory built by scripts/make_grpo_start.py; a path, so it works as --model_name_or_path as is.
GRPO_START = str(resources.files("hfpar") / "assets" / "grpo_start")


def grpo_start_path() -> str:
    """Directory of the shipped GRPO warm start (config.json, model.safetensors, tokenizer, chat template)."""
    return str(resources.files("hfpar") / "assets" / "grpo_start")


__all__ = sorted([*__all__, "GRPO_START", "grpo_start_path"])
