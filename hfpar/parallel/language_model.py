"""Where the language model of an HF model is: the model itself (a text causal LM), or a submodule of a multimodal
wrapper (Gemma-3's `model.language_model`, SmolVLM's `model.text_model`) whose settings sit in a nested text config.

    text_config(model.config)        # the text settings: heads, kv heads, layers, vocab (the config itself for a
                                     # text model; Gemma3Config -> its Gemma3TextConfig)
    is_nested(model.config)          # True for Gemma3ForConditionalGeneration, LLaVA, Fuyu, Qwen2-VL, ...
    language_model_path(model)       # "" for LlamaForCausalLM, "model.language_model" for Gemma-3's wrapper
    describe_nesting(model.config)   # "gemma3 (Gemma3ForConditionalGeneration) nests its language model
                                     #  (text_config gemma3_text)": the start of a one-line refusal

The language model is found by what it is, not by a list of names: the submodule whose `config` IS the text config
(transformers builds the language model from `config.text_config` itself), else the wrapper's `get_decoder()`.
Every part of hfpar that reads heads, layers or the vocabulary reads them from `text_config`, so a wrapper is sized
by its language model; the vision / audio towers are other submodules, replicated unless a plan names them.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = [
    "describe_nesting",
    "is_nested",
    "language_model",
    "language_model_path",
    "pipeline_refusal",
    "text_config",
]


def text_config(config):
    """The config holding the language model's settings. transformers' own `PretrainedConfig.get_text_config()`
    knows every family's nesting; decoder=True: the text model that generates (a config with both a text encoder and
    a decoder is ambiguous otherwise, and raises). A legacy encoder-decoder's flat config comes back as a renamed
    copy, which no module is built from: the config itself then. A config without the method (a user's
    SimpleNamespace) or None is returned as it is."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    text = get(decoder=True)
    return text if text is config or any(v is text for v in vars(config).values()) else config


def is_nested(config) -> bool:
    """Whether the language model's settings sit in a sub-config (a multimodal wrapper's)."""
    return config is not None and text_config(config) is not config


def describe_nesting(config, name: str | None = None) -> str:
    """'<model_type> (<architecture>) nests its language model (text_config <text model_type>)', for messages;
    name: the model's class (default: the config's first architecture)."""
    arch = name or (getattr(config, "architectures", None) or [None])[0]
    text = text_config(config)
    return (
        f"model_type {getattr(config, 'model_type', None)!r}{f' ({arch})' if arch else ''} nests its language model "
        f"(text_config {getattr(text, 'model_type', None)!r})"
    )


def pipeline_refusal(config, name: str | None = None) -> str | None:
    """Why pipeline stages cannot cut this model, for a multimodal wrapper (its forward runs the towers and the
    language model in one call, so no stage boundary falls between decoder layers); None for a text model."""
    if not is_nested(config):
        return None
    return (
        f"{describe_nesting(config, name)}; pipeline stages cut the decoder layers of a text causal LM only; valid: "
        "pp_size 1 (tensor, context, expert and data parallelism apply to its language model)"
    )


def language_model_path(model: nn.Module) -> str:
    """The dotted path of the language model inside `model` ("" when the model is a text model itself)."""
    config = getattr(model, "config", None)
    if not is_nested(config):
        return ""
    text = text_config(config)
    for name, m in model.named_modules():
        if name and getattr(m, "config", None) is text:
            return name
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    names = {id(m): n for n, m in model.named_modules()}
    if decoder is not None and names.get(id(decoder)):
        return names[id(decoder)]
    raise ValueError(
        f"{describe_nesting(config)}, but no submodule of {type(model).__name__} is built from it (none has that "
        "config and get_decoder() names none); pass plan= to apply_tensor_parallel"
    )


def language_model(model: nn.Module) -> nn.Module:
    """The language model submodule (the model itself for a text model)."""
    path = language_model_path(model)
    return model.get_submodule(path) if path else model
