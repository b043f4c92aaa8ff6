"""Where padding-free batching applies: each micro-batch's samples packed into rows (DataCollator(padding_free=True)),
or into one row where the attention skips the pairs between samples (`one_row`: DataCollator(one_row=True)).

    on, why_not = padding_free_mode(args, "lm", "llama", packed=args.packing)   # (True, None)

Packed rows keep samples apart only through the position ids: transformers 5 detects packed sequences from
them when there is no attention_mask (masking_utils.find_packed_sequence_indices) and then builds the
block-diagonal causal mask for eager / sdpa / flex attention (sliding windows included: a window is a distance
inside the sample, the same in both layouts) or uses varlen kernels for flash attention. That holds for the
model families below, verified sample by sample against each sample run alone (tests/unit/test_padding_free.py,
eager and sdpa on CPU in float64; also run once on an H100 with torch 2.11 / transformers 5.17: eager, sdpa and
flex_attention in fp32 and bf16, Llama, Mistral, Qwen3, Gemma2, Qwen3-MoE, GPT-2); other families (encoders,
encoder-decoders, models that build masks without the position ids or have
recurrent / chunked-attention layers) keep padded batches.
"""

from __future__ import annotations

# model_type -> verified in tests/unit/test_padding_free.py (a tiny random-init model of each: every sample's logits
# in a padding-free batch equal its logits alone)
FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "starcoder2",
    "gpt2",
)


# vision-language model types whose image rows pack (hfpar.data.vision.VisionCollator(padding_free=True)): 1-D
# position ids into a language model of FAMILIES, image features merged in the order of their image tokens; verified
# in tests/unit/test_sft_vision.py (every row's logits in a padding-free batch equal its logits alone)
VLM_FAMILIES = ("idefics3", "llava")

# attention implementations that spend no work on the masked pairs between a row's samples (varlen kernels, flex's
# block mask): with them each micro-batch goes into ONE row, packed rows concatenated too (no padding at all, as TRL's
# padding_free). sdpa and eager compute every block of the (T, T) block-diagonal mask, so with them rows stay at most
# --max_seq_length long and packed rows stay as they are.
ONE_ROW_ATTENTIONS = ("hfpar_varlen", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def one_row(args) -> bool:
    """Whether a padding-free micro-batch is one row (the attention skips the pairs between samples)."""
    return args.attn_implementation in ONE_ROW_ATTENTIONS


def _mask_attentions() -> tuple[str, ...]:
    """Attention implementations whose masks transformers builds from the packed position ids (transformers'
    masking_utils imported on use: why: docs/architecture.md#why-start-up-time)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: PLC0415

    return tuple(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys())


def _image_text_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def padding_free_mode(
    args, task: str, model_type: str | None, *, packed: bool, text_model_type: str | None = None, joins: bool = True
) -> tuple[bool, str | None]:
    """(pack each micro-batch's samples into rows?, why not, when it cannot apply).

    args: padding_free (None = wherever it applies, True, False), pp_size, attn_implementation.
    packed: the rows are packed already (--packing, the clm recipe): nothing to do, unless `one_row` and `joins`
    (the collator then concatenates them into one row per micro-batch; joins: it can, DataCollator(one_row=True)).
    text_model_type: a multimodal wrapper's language model type (its text_config's).
    """
    if args.padding_free is False or (packed and not (joins and one_row(args))):
        return False, None
    if task != "lm":
        return False, "sequence classification reads each row's last non-pad token, so classify keeps padded batches"
    if args.pp_size > 1:
        return False, (
            f"--pp_size {args.pp_size}: the pipeline cuts every batch into --pp_microbatches equal parts "
            "of rows, and padding-free batches vary in their number of rows"
        )
    if model_type in _image_text_types() and model_type not in VLM_FAMILIES:
        return False, (
            f"model_type {model_type!r} is a vision-language model not among those verified to keep packed image "
            f"rows apart ({', '.join(VLM_FAMILIES)}; Qwen-VL's 3-D position ids cannot mark samples)"
        )
    if model_type in VLM_FAMILIES:  # its language model must be a family of FAMILIES
        model_type = text_model_type
    if model_type not in FAMILIES:
        return False, (
            f"model_type {model_type!r} is not among the families verified to keep packed samples apart "
            f"({', '.join(FAMILIES)})"
        )
    attn = args.attn_implementation
    if attn is not None and attn not in _mask_attentions():
        return False, (
            f"--attn_implementation {attn}: transformers builds no packed-sequence mask for it "
            f"(it does for {', '.join(_mask_attentions())})"
        )
    return True, None
