"""A tied LM head in the final export (hfpar.checkpoint.final_model.without_tied_copies): gathered from FSDP2 shards,
the head and the embedding are two tensors, which save_pretrained wrote both of (it drops a tied name only where
the two share storage); the export now holds the embedding alone, as one process's save_pretrained does, and loads
back tied. An untied model keeps both. One process, tiny Llama."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from hfpar.checkpoint.final_model import without_tied_copies

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)


def test_tied_head_written_once_and_loads_tied(tmp_path):
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=True))
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}  # separate tensors, as gathered
    full = without_tied_copies(model, gathered)
    assert "lm_head.weight" not in full and "model.embed_tokens.weight" in full
    assert full.keys() == gathered.keys() - {"lm_head.weight"}
    keys = set(full)  # save_pretrained empties the dict it is given
    model.save_pretrained(tmp_path, state_dict=full, safe_serialization=True)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == keys
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert torch.equal(back.lm_head.weight, model.model.embed_tokens.weight)


def test_untied_head_kept():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=False))
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert without_tied_copies(model, gathered).keys() == gathered.keys()
