"""The preflight's refusals for context and pipeline parallelism (cp modes, pipeline schedules, interleaving, what
combines with them), in process, with a ParallelContext of any world size.

    python -m pytest -q tests/launch/test_preflight_parallel.py
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, GPT2Config, LlamaConfig

from hfpar import preflight as pf
from hfpar.config import ConfigError, parse_args
from hfpar.context import ParallelContext
from tests.helpers.preflight import _args


def test_context_parallel_refusals_and_mode(tmp_path):
    """Decided by what the model does (a meta-device probe): attention computed outside transformers' registry
    (XGLM), attention dropout (GPT-2's default) refused naming the module; sliding windows accepted; Ulysses with
    heads not divisible by cp; auto picks Ulysses only when heads and kv heads divide by cp; classify and flash
    attention refused with --cp_size."""
    ctx = ParallelContext.plan(4, cp=4)
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, gpt2) == [
        (
            "--cp_size 4: GPT2Attention uses attention dropout 0.1 (set attention_dropout 0), which hfpar's "
            "context-parallel attention does not implement"
        )
    ]
    gpt2.attn_pdrop = 0.0
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, gpt2) == []  # not a list of names: GPT-2 routes
    xglm = AutoConfig.for_model(
        "xglm", d_model=32, num_layers=1, attention_heads=2, vocab_size=64, dropout=0.0, attention_dropout=0.0
    )
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, xglm) == [
        (
            "--cp_size 4: XGLMAttention (model.layers.0.self_attn) computes attention itself instead of calling "
            "transformers' attention registry (attn_implementation), which context parallelism replaces"
        )
    ]
    mistral = AutoConfig.for_model(
        "mistral",
        num_attention_heads=8,
        num_key_value_heads=4,
        sliding_window=4096,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=64,
    )
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, mistral) == []
    # a hybrid whose attention layers call the registry beside layers that carry state along the row: those run on
    # the whole rows (Qwen3-Next trained a loss 5.6e-4 from one process before them, fp32; now refused no more: LFM3's
    # short convolutions here, the fastest tiny copy); an attention module with convolutions of its own is refused
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, AutoConfig.for_model("lfm3")) == []
    assert pf.cp_problems(_args("--cp_size", "4"), ctx, AutoConfig.for_model("zaya")) == [
        (
            "--cp_size 4: model.layers.0.self_attn (ZayaAttention) mixes tokens outside the attention (its output at "
            "one position moves with another position's token: state carried along the sequence, a convolution or a "
            "linear attention) and calls the attention itself, so context parallelism, cutting the row over the cp "
            "ranks, can neither compute it on this rank's part alone nor run it on the whole row"
        )
    ]
    llama6 = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, num_hidden_layers=1)
    lines = pf.cp_problems(_args("--cp_size", "4", "--cp_mode", "ulysses"), ctx, llama6)
    assert lines == [
        "--cp_mode ulysses: 6 attention heads are not divisible by --cp_size 4; use --cp_mode ring (or auto)"
    ]
    for heads, kv, mode in ((8, 4, "ulysses"), (8, 2, "ring"), (6, 6, "ring")):
        c = ParallelContext.plan(4, cp=4)
        cfg = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=heads * 8, num_hidden_layers=1)
        got = pf.resolve_cp_mode(_args("--cp_size", "4"), c.tp, c.cp, cfg)  # the run plan's (no side effect on c)
        assert pf.cp_problems(_args("--cp_size", "4"), c, cfg) == [] and got == mode, (heads, kv, got)
    lines = pf.feature_problems(_args("--cp_size", "2", "--attn_implementation", "flash_attention_2"), ctx, "classify")
    assert any("context parallelism is available for causal-LM recipes" in x for x in lines)
    assert any("--attn_implementation flash_attention_2" in x for x in lines)


def test_pipeline_refusals(tmp_path):
    """pp not dividing the world, fewer layers than stages, a split leaving a stage empty, micro-batches not
    dividing the batch, an encoder model, classify / LoRA, and the compositions not supported."""
    from hfpar.backends import select_backend

    assert "--pp_size 3 does not divide the world size 4" in ParallelContext(world=4, pp=3).problems()[0]
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, tie_word_embeddings=False)
    ctx4 = ParallelContext.plan(4, pp=4)
    assert pf.pp_model_problems(_args("--pp_size", "4"), ctx4, llama) == [
        "--pp_size 4: llama has 2 decoder layers, fewer than the stages"
    ]
    llama8 = LlamaConfig(num_hidden_layers=8, hidden_size=32, num_attention_heads=4, tie_word_embeddings=False)
    assert (
        "every stage non-empty"
        in pf.pp_model_problems(_args("--pp_size", "4", "--pp_split", "0,2,2,6"), ctx4, llama8)[0]
    )
    assert pf.pp_model_problems(_args("--pp_size", "4", "--pp_split", "0,2,4,6"), ctx4, llama8) == []
    tied = LlamaConfig(num_hidden_layers=8, hidden_size=32, num_attention_heads=4, tie_word_embeddings=True)
    assert pf.pp_model_problems(_args("--pp_size", "4"), ctx4, tied) == []  # tied: first and last stage sum grads
    bert = AutoConfig.for_model("bert", architectures=["BertForMaskedLM"])
    assert "not a decoder-only causal LM" in pf.pp_model_problems(_args("--pp_size", "4"), ctx4, bert)[0]
    t5 = AutoConfig.for_model("t5")
    assert "not a decoder-only causal LM" in pf.pp_model_problems(_args("--pp_size", "4"), ctx4, t5)[0]
    lines = pf.feature_problems(
        _args("--pp_size", "2", "--per_device_train_batch_size", "6", "--pp_microbatches", "4", "--use_peft"),
        ParallelContext.plan(2, pp=2),
        "classify",
    )
    assert any(
        "--pp_microbatches 4 does not divide --per_device_train_batch_size 6; valid: 1, 2, 3, 6" in x for x in lines
    )
    assert any("pipeline parallelism is available for causal-LM recipes" in x for x in lines)
    assert not any("--use_peft" in x for x in lines)  # LoRA composes with pipeline parallelism
    for strategy, parallelisms, text in (
        ("zero2", ("pp",), "DeepSpeed refuses them with its own pipeline"),
        ("zero3", ("tp", "pp"), "DeepSpeed refuses them with its own pipeline"),
        ("fsdp1", ("tp", "pp"), "FSDP1 is not supported"),
        ("zero2", ("tp", "ep", "cp", "pp"), "DeepSpeed refuses them"),
    ):
        with pytest.raises(ConfigError, match=text):
            select_backend(strategy, parallelisms, {"pp": 2, "tp": 2})
    assert "--pp_schedule 'zb'" in str(
        pytest.raises(ConfigError, parse_args, ["--pp_schedule", "zb"], recipe="sft").value
    )


def test_pipeline_zero1_refuses_mixed_precision_and_skipping():
    """PP x ZeRO-1 runs fp32 only (DeepSpeed's bf16 / fp16 optimizers take grads in its engine's backward, which the
    schedule bypasses) and steps before the trainer sees the norm: one line each, naming the value and the way out."""
    from hfpar.backends import PipelineZeRO1, select_backend

    ctx = ParallelContext.plan(4, pp=2)
    assert select_backend("zero1", ("pp",), {"pp": 2}) is PipelineZeRO1
    assert PipelineZeRO1.check(_args("--pp_size", "2"), ctx, "zero1", "no") == []
    for mp in ("bf16", "fp16"):
        (line,) = PipelineZeRO1.check(_args("--pp_size", "2"), ctx, "zero1", mp)
        assert line.startswith(f"--pp_size 2 with zero1 and {mp}: ") and "--mixed_precision no" in line
    (line,) = PipelineZeRO1.check(_args("--pp_size", "2", "--on_nonfinite", "skip"), ctx, "zero1", "no")
    assert line.startswith("--on_nonfinite skip with zero1: ") and "--on_nonfinite error" in line


def test_pipeline_schedules_listed_once():
    from hfpar.config import PP_SCHEDULES
    from hfpar.parallel.pipeline import SCHEDULES

    assert PP_SCHEDULES == SCHEDULES


def test_interleaved_pipeline_refusals():
    """interleaved_1f1b: at least 2 chunks per rank, V x pp layers at least, micro-batches a multiple of pp (given,
    or by default), and --pp_split naming the first layer of each of the V x pp virtual stages."""

    inter = ("--pp_schedule", "interleaved_1f1b")
    err = str(pytest.raises(ConfigError, parse_args, [*inter, "--pp_virtual_stages", "1"], recipe="sft").value)
    assert "--pp_virtual_stages 1: interleaved_1f1b needs >= 2 chunks per rank" in err
    assert parse_args(["--pp_virtual_stages", "1"], recipe="sft").pp_virtual_stages == 1  # unused unless interleaved
    ctx2, ctx4 = ParallelContext.plan(2, pp=2), ParallelContext.plan(4, pp=4)
    llama6 = LlamaConfig(num_hidden_layers=6, hidden_size=32, num_attention_heads=4, tie_word_embeddings=False)
    assert pf.pp_model_problems(_args("--pp_size", "2", *inter, "--pp_virtual_stages", "4"), ctx2, llama6) == [
        "--pp_virtual_stages 4 x --pp_size 2: llama has 6 decoder layers, fewer than the 8 virtual stages; "
        "valid: --pp_virtual_stages 2..3"
    ]
    assert pf.pp_model_problems(_args("--pp_size", "4", *inter), ctx4, llama6) == [
        "--pp_virtual_stages 2 x --pp_size 4: llama has 6 decoder layers, fewer than the 8 virtual stages; "
        "valid: --pp_schedule 1f1b or gpipe"
    ]
    assert pf.pp_model_problems(_args("--pp_size", "2", *inter, "--pp_virtual_stages", "3"), ctx2, llama6) == []
    assert pf.pp_model_problems(_args("--pp_size", "2", *inter, "--pp_split", "0,2,4"), ctx2, llama6) == [
        "--pp_split '0,2,4': needs 4 increasing first-layer indices starting at 0 and below 6 (every stage non-empty), "
        "e.g. 0,1,3,4"
    ]
    assert pf.pp_model_problems(_args("--pp_size", "2", *inter, "--pp_split", "0,1,3,4"), ctx2, llama6) == []
    bad = pf.pp_feature_problems(
        _args("--pp_size", "2", *inter, "--per_device_train_batch_size", "6", "--pp_microbatches", "3"), "lm"
    )
    assert bad == [
        "--pp_microbatches 3: interleaved_1f1b needs a multiple of --pp_size 2 that divides "
        "--per_device_train_batch_size 6"
    ]
    odd = pf.pp_feature_problems(_args("--pp_size", "2", *inter, "--per_device_train_batch_size", "3"), "lm")
    assert odd == [
        "--pp_schedule interleaved_1f1b: no multiple of --pp_size 2 divides --per_device_train_batch_size 3; "
        "valid: a batch that is a multiple of 2"
    ]
    assert pf.pp_feature_problems(_args("--pp_size", "2", *inter, "--per_device_train_batch_size", "6"), "lm") == []
    # the chunks compose like one stage per rank: TP, LoRA, FSDP2 and ZeRO-1 accepted (parity: test_pp_parity.py,
    # test_lora.py)
    assert pf.pp_feature_problems(_args("--pp_size", "2", *inter, "--tp_size", "2", "--use_peft"), "lm") == []
    from hfpar.backends import PipelineFSDP2, PipelineZeRO1, select_backend

    assert select_backend("fsdp2", ("pp",), {"pp": 2}) is PipelineFSDP2
    for cls, strategy in ((PipelineFSDP2, "fsdp2"), (PipelineZeRO1, "zero1")):
        for flags in ((), inter):
            assert cls.check(_args("--pp_size", "2", *flags), ParallelContext.plan(4, pp=2), strategy, "no") == []
