"""Tiny multimodal wrappers (a language model nested in `text_config`, a vision / audio tower beside it) for the
tests of tests/distributed/test_multimodal_wrappers.py: the family sweep's tiny config (text and towers shrunk by the
same rules), built by the class transformers' own Auto mapping gives it, in float32.

    model = build_vlm("gemma3")        # Gemma3ForConditionalGeneration, as AutoModelForCausalLM returns it
    model = build_vlm("llava")         # LlavaForConditionalGeneration (AutoModelForImageTextToText only)
    model = build_vlm("llama4", image_text=True)   # Llama4ForConditionalGeneration: MoE text model, vision tower
    worst, name = tp_step_diff(model, ref, ids)   # TP model vs one process: loss and every gradient, then SGD
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers.tp_parity import _full_grads, _rel

# AutoModelForCausalLM builds these wrappers (the five the held-out TP sweep crashed on: issue 42)
CAUSAL = ("gemma3", "gemma4", "gemma4_unified", "fuyu", "moss_transcribe_diarize")
# only AutoModelForImageTextToText builds these (hfpar's causal-LM recipes refuse them in the preflight)
IMAGE_TEXT = ("llava", "mistral3", "smolvlm")


def build_vlm(model_type: str, seed: int = 0, attn: str = "eager", image_text: bool = False):
    """image_text: AutoModelForImageTextToText's class even where AutoModelForCausalLM has one (Llama-4: its
    Llama4ForCausalLM is the text model alone). MoE experts: the eager implementation."""
    cfg = tiny_config(model_type)
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not image_text
    cls = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    torch.manual_seed(seed)
    return cls.from_config(cfg, attn_implementation=attn, experts_implementation="eager").float().train()


def text_batch(vocab: int, seed: int = 1) -> torch.Tensor:
    """(2, 8) token ids above the special ids (text only: no image tokens)."""
    return torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))


def tp_step_diff(model, ref, ids: torch.Tensor, lr: float = 0.1) -> tuple[float, str]:
    """Loss and every gradient of the TP model (shards gathered) against one process, then one SGD step on both:
    (the worst relative difference, its name). Names of the gradients must match."""
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = {n: g for n, g in _full_grads(model).items() if g is not None}
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:4]
    worst = max([(_rel(loss.detach(), ref_loss.detach()), "loss")] + [(_rel(got[n], want[n]), n) for n in want])
    with torch.no_grad():
        for m in (model, ref):
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
    return worst


def sharded_modules(model, prefix: str) -> list[str]:
    """Names of the tensor-parallel layers under `prefix` ("" = anywhere)."""
    kinds = (ColumnParallelLinear, RowParallelLinear)
    return [n for n, m in model.named_modules() if isinstance(m, kinds) and n.startswith(prefix)]
