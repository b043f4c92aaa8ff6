"""What hfpar.loading.sharded reads into: the HF model behind a parallelized one, and each tensor's name in it.

    hf, hf_name = hf_view(model)     # model: an HF model, a PEFT model (LoRA), a PipelineStage / PipelineChunks
    hf_name("lm.model.layers.0.self_attn.q_proj.base_layer.weight")  -> "model.layers.4.self_attn.q_proj.weight"

The checkpoint's keys are renamed / converted by transformers' conversion mapping of `hf` (its class and config),
then matched against these names, so a pipeline stage reads only its own layers (stage -> global layer index,
PipelineStage.hf_name), LoRA's base layers read their base weights (PEFT's `base_layer` / `original_module`
infixes dropped) and the last stage's copy of tied embeddings reads the input embedding's key, as the full model's
one tied tensor does (its LM head key is absent from a tied checkpoint). Tensors PEFT creates (adapters) are real
at load time (initialised as PEFT does), so the loader never looks them up.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch.nn as nn

__all__ = ["hf_view"]

# PEFT's wrappers around a base module: tuners' base_layer (LoRA), ModulesToSaveWrapper's original / trained copy
_PEFT_INFIX = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_PEFT_PREFIX = "base_model.model."


def _peft_free(name: str) -> str:
    """A PEFT model's name of a base-model tensor -> the base model's name."""
    name = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
    return _PEFT_INFIX.sub("", name)


def _tied_alias(hf: nn.Module, ties: bool) -> dict[str, str]:
    """{output embedding name: input embedding name} when the (full) model ties them, else {}."""
    keys = getattr(hf, "_tied_weights_keys", None)
    return dict(keys) if ties and isinstance(keys, dict) else {}


def hf_view(model: nn.Module) -> tuple[nn.Module, Callable[[str], str]]:
    """(the HF model whose class / config / conversion mapping apply, this model's state-dict name -> the full
    HF model's name)."""
    if hasattr(model, "hf_name") and hasattr(model, "ties_embeddings"):  # PipelineStage / PipelineChunks
        first = model.chunks[0] if hasattr(model, "chunks") else model
        hf = first.lm
        alias = _tied_alias(hf, model.ties_embeddings)
        return hf, lambda n: (lambda full: alias.get(full, full))(_peft_free(model.hf_name(n)))
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # PEFT (LoRA)
        return model.get_base_model(), _peft_free
    return model, lambda n: n
