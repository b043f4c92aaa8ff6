"""Context parallelism refuses models that compute otherwise once their rows are cut, and honours attention sinks
(hfpar.parallel.context_parallel.shard_check, probe): the run's tiny float64 copy whole with its stock attention
against the same copy cut over two emulated cp ranks (threads, hfpar's CP attention function). Llama 4 (chunked
attention, a temperature from the local sequence length) and Doge (a learned dynamic mask) trained other math under
CP without a word (benchmarks/context_parallel/family_sweep.py); Doge is refused, Llama 4 now computes the same (its
chunks as documents of the layer's row layout, its temperature from the whole row's index: each named by the check
when switched off); the families accepted here are exact under real cp ranks there. The meta probe's fallback to
the tiny copy (GPT-2 reads a value: `.item()`), the class-table families named (Falcon). Dynamic rotary embeddings
(Phi-3's longrope) given the whole rows' largest position. One process, ~10 s.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoConfig, GPT2Config

from hfpar.parallel.context_parallel import enable_cp_attention
from hfpar.parallel.context_parallel.probe import cp_attention_problems
from hfpar.parallel.context_parallel.shard_check import EmulatedGroup, _compare, shard_problem
from hfpar.parallel.tiny_copy import build_float64, tiny_model

DIFFER = {  # model_type: where the cut rows first part from the whole row
    "doge": "the gradient of model.layers.0.self_attn.A differs by",
}
# plain, sliding windows with a soft cap, sinks with windows and experts, MLA, no-RoPE layers, partial rotary, chunked
# attention with a temperature on the NoPE layers
SAME = ("llama", "gemma2", "gpt_oss", "deepseek_v3", "smollm3", "phi", "cohere2", "llama4_text")


@pytest.mark.parametrize("model_type", sorted(DIFFER))
def test_models_that_compute_otherwise_when_cut_are_named(model_type):
    why = shard_problem(AutoConfig.for_model(model_type))
    assert why is not None and why.startswith(DIFFER[model_type]), why
    assert "when its rows are cut over the cp ranks" in why and "\n" not in why


@pytest.mark.parametrize("model_type", SAME)
def test_models_that_compute_the_same_pass(model_type):
    assert shard_problem(AutoConfig.for_model(model_type)) is None


def test_a_model_reading_the_local_length_is_found():
    """A rotary embedding fed arange(local length) instead of the position ids (what Llama 4's temperature does):
    the check can fail, and names the first module that moves."""
    model = tiny_model(AutoConfig.for_model("llama"))
    assert _compare(model) is None
    rotary = model.model.rotary_emb
    forward = rotary.forward

    def local_positions(x, position_ids):
        return forward(x, torch.arange(position_ids.shape[-1]).expand_as(position_ids))

    rotary.forward = local_positions
    why = _compare(model)
    assert why is not None and why.startswith("model.rotary_emb (LlamaRotaryEmbedding) differs by"), why


def _longrope_phi3():
    """Phi-3 with longrope whose threshold (original_max_position_embeddings 13) lies between the ranks' largest
    positions of a 16-token row at cp = 2 (15 on rank 0, 11 on rank 1): rank 1 alone would pick the short factors."""
    return AutoConfig.for_model(
        "phi3",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        original_max_position_embeddings=13,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 13,
            "short_factor": [1.0, 1.1, 1.3, 1.5],
            "long_factor": [2.0, 3.0, 5.0, 9.0],
        },
    )


def test_dynamic_rotary_sees_the_whole_rows(monkeypatch):
    """longrope picks its factors from the largest position id it is given: under CP each rank would see its own
    (rotary.py gives it the whole rows'). Exact with it; without it the check names the rotary module."""
    from hfpar.parallel.context_parallel import adapt

    assert _compare(build_float64(_longrope_phi3())) is None
    monkeypatch.setattr(adapt, "cp_rotary", lambda model: [])
    why = _compare(build_float64(_longrope_phi3()))
    assert why is not None and why.startswith("model.rotary_emb (Phi3RotaryEmbedding) differs by"), why


def test_enable_cp_attention_refuses_it_in_users_code():
    model = tiny_model(AutoConfig.for_model("doge"))
    with pytest.raises(ValueError, match=r"^context parallelism: the gradient of model.layers.0.self_attn.A differs"):
        enable_cp_attention(model)


@pytest.mark.parametrize(
    "switched_off, named",
    [("chunks", "model.layers.0.self_attn (Llama4TextAttention)"), ("temperature", "model.layers.3.self_attn")],
)
def test_llama4_needs_its_chunks_and_its_temperature(monkeypatch, switched_off, named):
    """Llama 4 computes the same under CP with both (the SAME list above); without either, the check names the first
    layer that differs: a chunked layer without its chunks, the NoPE layer (its 4th) without its temperature."""
    from hfpar.parallel.context_parallel import adapt, layout

    if switched_off == "chunks":
        monkeypatch.setattr(layout.RowLayout, "chunked", lambda self, chunk: self)
    else:
        monkeypatch.setattr(adapt, "cp_temperature", lambda model: [])
    why = _compare(tiny_model(AutoConfig.for_model("llama4_text")))
    assert why is not None and why.startswith(named), why


def test_llama4_temperature_is_its_own_outside_cp_rows():
    """enable_cp_attention turns the NoPE layers' own scaling off inside cp_rows only: outside (generation with whole
    rows: whole_sequence) the module reads its own setting, as transformers' code does."""
    from hfpar.parallel.context_parallel import cp_rows, shard_batch, shift_labels

    model = tiny_model(AutoConfig.for_model("llama4_text"))
    enable_cp_attention(model)
    nope = [m for m in model.modules() if type(m).__name__ == "ContextParallelLlama4TextAttention"]
    assert nope and all(not m.use_rope and m.attn_temperature_tuning for m in nope)
    ids = torch.arange(16)[None]
    _, rows = shard_batch(shift_labels({"input_ids": ids, "labels": ids}), 0, 2)
    with cp_rows(rows, None, "ring"):
        assert not any(m.attn_temperature_tuning for m in nope)
    assert all(m.attn_temperature_tuning for m in nope)


def test_an_emulated_rank_that_fails_releases_the_others():
    """A rank raising before the exchange: its error comes back, the other rank does not wait for ever."""
    group = EmulatedGroup(2)

    def fn(rank):
        if rank == 1:
            raise RuntimeError("rank 1 fails")
        q = torch.zeros(1, 1, 2, 4)
        return group.attention(q, q, q, None, group)

    with pytest.raises(RuntimeError, match="rank 1 fails"):
        group.run(fn, [(), ()])
    assert not any(t.name.endswith("(body)") for t in threading.enumerate())  # every emulated rank ended


def test_probe_runs_the_tiny_copy_where_meta_cannot():
    """GPT-2's forward reads a value (`.item()`) the meta device cannot give: its tiny copy is probed instead, with
    the config's attention dropout kept (refused, named), and accepted with it off. Falcon picks its attention class
    from a table of its own: named as such."""
    gpt2 = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64)
    assert cp_attention_problems(gpt2) == [
        "GPT2Attention uses attention dropout 0.1 (set attention_dropout 0), which hfpar's context-parallel "
        "attention does not implement"
    ]
    gpt2.attn_pdrop = 0.0
    assert cp_attention_problems(gpt2) == []
    (line,) = cp_attention_problems(AutoConfig.for_model("falcon"))
    assert "its attention modules are picked from a table of its own" in line, line
