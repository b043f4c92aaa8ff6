"""Where padding-free batching applies: each micro-batch's samples packed into rows (DataCollator(padding_free=True)),
or into one row where the attention skips the pairs between samples (`one_row`: DataCollator(one_row=True)).

    on, why_not = padding_free_mode(args, "lm", config, packed=args.packing)   # (True, None)

Packed rows keep samples apart only through the position ids: transformers 5 detects packed sequences from
them when there is no attention_mask (masking_utils.find_packed_sequence_indices) and then builds the
block-diagonal causal mask for eager / sdpa / flex attention (sliding windows included: a window is a distance
inside the sample, the same in both layouts) or uses varlen kernels for flash attention. Whether a model's code does
so is checked on the model itself, not looked up by its name: hfpar.data.packing_probe runs a tiny float64 copy of
it (the run's config, widths shrunk) on one padding-free batch against each sample alone. Families whose masks
ignore the position ids (OPT, BLOOM), whose layers carry state along the row (Mamba, linear attention) or encoders
keep padded batches, with the reason in the log (refused in one line where --padding_free true asks for them).
Checked on a GPU once (an H100, torch 2.11 / transformers 5.17): eager, sdpa and flex_attention in fp32 and bf16,
Llama, Mistral, Qwen3, Gemma2, Qwen3-MoE, GPT-2.
"""

from __future__ import annotations

from ..parallel.language_model import text_config
from .packing_probe import packing_problem

# vision-language model types whose image rows pack (hfpar.data.vision.VisionCollator(padding_free=True)): 1-D
# position ids into a language model that keeps packed samples apart, image features merged in the order of their
# image tokens; verified in tests/unit/test_sft_vision.py (every row's logits in a padding-free batch equal its
# logits alone)
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


def padding_free_mode(args, task: str, config, *, packed: bool, joins: bool = True) -> tuple[bool, str | None]:
    """(pack each micro-batch's samples into rows?, why not, when it cannot apply).

    args: padding_free (None = wherever it applies, True, False), pp_size, attn_implementation.
    config: the model's config (a multimodal wrapper's language model is the one checked: its text config).
    packed: the rows are packed already (--packing, the clm recipe): nothing to do, unless `one_row` and `joins`
    (the collator then concatenates them into one row per micro-batch; joins: it can, DataCollator(one_row=True)).
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
    model_type = getattr(config, "model_type", None)
    if model_type in _image_text_types() and model_type not in VLM_FAMILIES:
        return False, (
            f"model_type {model_type!r} is a vision-language model not among those verified to keep packed image "
            f"rows apart ({', '.join(VLM_FAMILIES)}; Qwen-VL's 3-D position ids cannot mark samples)"
        )
    attn = args.attn_implementation
    if attn is not None and attn not in _mask_attentions():
        return False, (
            f"--attn_implementation {attn}: transformers builds no packed-sequence mask for it "
            f"(it does for {', '.join(_mask_attentions())})"
        )
    # the language model's own code decides (a VLM of VLM_FAMILIES: its text model; image rows: vision.py)
    problem = packing_problem(text_config(config) if model_type in VLM_FAMILIES else config, attn)
    if problem:
        return False, f"model_type {model_type!r}: {problem}"
    return True, None
