"""`hfpar plan` from a model's config alone: recommendations, byte accounting, the chunked loss, host RAM, errors.

    python -m pytest -q tests/unit/test_planner.py

The estimator against bytes measured in real runs: tests/launch/test_plan.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig

from hfpar.cli import main as cli
from hfpar.parallel.chunked_loss import LOGITS_PER_CHUNK
from hfpar.planner.memory import HOST_OVERHEAD, activation_bytes
from hfpar.planner.table import Candidate, _pp_worst, estimate, launch_command, model_stats
from hfpar.planner.table import PlannerError as PlanError
from hfpar.planner.table import memory_table as plan


def llama_dir(tmp_path, name: str, hidden: int, layers: int, heads: int, intermediate: int):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "intermediate_size": intermediate,
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
            }
        )
    )
    return d


def plan_output(capsys, argv: list[str]) -> str:
    cli(["plan", *argv])
    return capsys.readouterr().out


def test_plan_recommends_ddp_for_125m(tmp_path, capsys):
    model = llama_dir(tmp_path, "llama-125m", 768, 12, 12, 3072)
    out = plan_output(capsys, ["--model", str(model), "--num_gpus", "8", "--gpu_memory_gb", "80"])
    assert "recommended: DDP\n" in out
    assert (
        f"accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 8 recipes/sft.py "
        f"--model_name_or_path {model}"
    ) in out


def test_plan_recommends_sharding_for_7b(tmp_path, capsys):
    model = llama_dir(tmp_path, "llama-7b", 4096, 32, 32, 11008)
    out = plan_output(capsys, ["--model", str(model), "--num_gpus", "8", "--gpu_memory_gb", "80"])
    assert "recommended: FSDP2" in out or "recommended: ZeRO-3" in out
    assert "accelerate_configs/fsdp2.yaml --num_processes 8" in out or "accelerate_configs/zero3.yaml" in out
    ddp = next(line for line in out.splitlines() if line.startswith("DDP "))
    assert ddp.endswith("no"), ddp  # 16 bytes x 6.7B params do not fit in 80 GB


@pytest.mark.parametrize(
    "gpu_memory_gb, recommended, config, extra",
    [
        # (chunked LM loss, the recipe's default; activations as measured, hfpar.planner.memory.activation_bytes:
        # bf16 weights under FSDP2 / ZeRO-3) 40 GiB (budget 36.0): FSDP2 needs 49.81 GiB, 28.76 with checkpointing
        (40, "FSDP2 with activation checkpointing", "fsdp2", " --gradient_checkpointing"),
        # 31.5 GiB (budget 28.35): FSDP2 with checkpointing needs 28.76 GiB, FSDP2 + TP2 27.94
        (31.5, "FSDP2 + TP2 with activation checkpointing", "fsdp2", " --tp_size 2 --gradient_checkpointing"),
        # 27 GiB (budget 24.3): no GPU-resident strategy fits even with checkpointing; offload needs 24.71 GiB
        (27, "ZeRO-3 offload with activation checkpointing", "zero3_offload", " --gradient_checkpointing"),
        # 28 GiB (budget 25.2): FSDP2 + TP2 with checkpointing (27.94 GiB) does not fit; offload does without (24.71)
        (28, "ZeRO-3 offload", "zero3_offload", ""),
    ],
)
def test_plan_recommendation_for_7b_on_two_nodes(tmp_path, capsys, gpu_memory_gb, recommended, config, extra):
    """7B, seq 4096, 2 nodes x 2 GPUs: the first rung of the rule (DDP -> FSDP2/ZeRO-3 -> TP/EP -> offload,
    checkpointing only when needed) that fits, and its exact multi-node launch command."""
    model = llama_dir(tmp_path, "llama-7b", 4096, 32, 32, 11008)
    out = plan_output(
        capsys,
        [
            "--model",
            str(model),
            "--num_gpus",
            "2",
            "--gpu_memory_gb",
            str(gpu_memory_gb),
            "--seq_len",
            "4096",
            "--num_nodes",
            "2",
        ],
    )
    lines = out.splitlines()
    i = lines.index(f"recommended: {recommended}")
    assert lines[i + 1] == (
        f"accelerate launch --config_file accelerate_configs/{config}.yaml --num_processes 4 --num_machines 2 "
        f"--machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 recipes/sft.py "
        f"--model_name_or_path {model} --max_seq_length 4096 --per_device_train_batch_size 1{extra}"
    ), lines[i + 1]
    assert sum(line.startswith("recommended: ") for line in lines) == 1


def test_bytes_per_param_accounting(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama_dir(tmp_path, "m", 768, 12, 12, 3072))
    n = sum(p.numel() for p in _meta_model(config).parameters())
    bf16 = estimate(config, "ddp", 8)
    assert (bf16["params"], bf16["grads"], bf16["optimizer"]) == (2 * n, 2 * n, 12 * n)
    z3 = estimate(config, "zero3", 8, mixed_precision="no")
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (4 * n // 8, 4 * n // 8, 8 * n // 8)
    z1, z2 = estimate(config, "zero1", 8), estimate(config, "zero2", 8)
    assert z1["grads"] == 2 * n and z2["grads"] == 2 * n // 8 and z1["optimizer"] == z2["optimizer"] == 12 * n // 8
    ckpt = estimate(config, "ddp", 8, checkpointing=True)
    assert ckpt["activations"] < bf16["activations"]


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_gpus", "0", "--gpu_memory_gb", "80"], "--num_gpus: 0 must be > 0"),
        (
            ["--num_gpus", "8", "--gpu_memory_gb", "80", "--tp_size", "5"],
            "--tp_size 5 does not divide num_attention_heads 12",
        ),
        (
            ["--num_gpus", "8", "--gpu_memory_gb", "80", "--loss_chunk_size", "-3"],
            "--loss_chunk_size -3: must be >= 1 token, 0 (off) or unset (auto)",
        ),
        (
            ["--num_gpus", "8", "--gpu_memory_gb", "80", "--loss_chunk_size", "two"],
            "--loss_chunk_size: invalid int value: 'two'",
        ),
    ],
)
def test_plan_errors_are_one_line(tmp_path, capsys, argv, message):
    model = llama_dir(tmp_path, "m", 768, 12, 12, 3072)
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--model", str(model), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("hfpar: error: ") and err.count("\n") == 1 and message in err, err


def test_plan_missing_model_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--model", str(tmp_path / "nope"), "--num_gpus", "8", "--gpu_memory_gb", "80"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"--model {tmp_path / 'nope'}: no such model directory" in err


@pytest.mark.parametrize("tool", ["plan", "plot", "export"])
def test_help(tool, capsys):
    with pytest.raises(SystemExit) as e:
        cli([tool, "--help"])
    assert e.value.code == 0 and f"usage: hfpar {tool}" in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_plan_context_parallel_estimate_and_recommendation():
    """cp cuts every row's tokens over the cp ranks: activations / cp, states sharded over dp x cp; the plan
    recommends CP (without recomputation) when activations dominate at the requested seq_len, not otherwise."""
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    one = estimate(cfg, "fsdp2", 8, seq_len=65536, loss_chunk_size=0)  # exact halving with the full logits (the
    two = estimate(cfg, "fsdp2", 8, seq_len=65536, cp_size=2, loss_chunk_size=0)  # chunked loss has a fixed part)
    assert abs(two["activations"] / one["activations"] - 0.5) < 1e-6 and two["params"] == one["params"]
    with pytest.raises(PlanError, match="--tp_size 2 x --cp_size 3 = 6 does not divide the world size 8"):
        estimate(cfg, "fsdp2", 8, tp_size=2, cp_size=3)
    text, cand = plan(cfg, "llama-7b", num_gpus=8, gpu_memory_gb=80, seq_len=65536)
    assert cand.cp > 1 and f"--cp_size {cand.cp}" in text and "--gradient_checkpointing" not in text.splitlines()[-1]
    _, short = plan(cfg, "llama-7b", num_gpus=8, gpu_memory_gb=80, seq_len=2048)
    assert short.cp == 1


def test_plan_pipeline_stages_schedules_and_recommendation():
    """pp: each stage's states (embedding on the first, head on the last, balanced like hfpar's split), the
    micro-batches in flight of each schedule (GPipe m, 1F1B p - s, interleaved Megatron's warm-up + 1 chunk
    micro-batches), the bubble (p - 1) / (m + p - 1), / V interleaved; recommended with one stage per node when
    DDP does not fit on several nodes, not on one node where FSDP2 / CP fit."""
    from hfpar.planner.pipeline import bubble_fraction, pipeline_estimate
    from hfpar.planner.table import model_stats, state_bytes_per_param

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
    stats = model_stats(cfg)
    assert stats.n_embed == stats.n_head == stats.n_head_untied == 32000 * 4096
    bp, bg, bo = state_bytes_per_param("bf16")
    flight = {}
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        rows, bubble = pipeline_estimate(stats, 4, 8, schedule=schedule, seq_len=4096, batch_size=8)
        assert sum(r["layers"] for r in rows) == 32 and sum(r["params"] for r in rows) == pytest.approx(
            stats.n_params * bp, rel=1e-6
        )
        assert all(
            r["grads"] * bp == r["params"] * bg and r["optimizer"] * bp == pytest.approx(r["params"] * bo, rel=1e-9)
            for r in rows
        )
        assert rows[0]["params"] > rows[1]["params"] and rows[-1]["params"] > rows[1]["params"]  # embedding / head
        flight[schedule] = [r["in_flight"] for r in rows]
        assert bubble == pytest.approx(3 / 11 / (2 if schedule == "interleaved_1f1b" else 1))
    assert flight == {"gpipe": [8, 8, 8, 8], "1f1b": [4, 3, 2, 1], "interleaved_1f1b": [11, 9, 7, 5]}
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 22)
    gpipe, _ = pipeline_estimate(stats, 4, 8, schedule="gpipe", seq_len=4096, batch_size=8)
    onef, _ = pipeline_estimate(stats, 4, 8, schedule="1f1b", seq_len=4096, batch_size=8)
    assert onef[1]["activations"] * 8 == pytest.approx(gpipe[1]["activations"] * 3, rel=1e-6)  # 3 of 8 in flight
    with pytest.raises(PlanError, match="the model has 32 layers, fewer than the stages"):
        pipeline_estimate(stats, 32, 32, schedule="interleaved_1f1b", batch_size=32)
    with pytest.raises(PlanError, match="--pp_microbatches 6: must divide --batch_size 8"):
        pipeline_estimate(stats, 2, 8, microbatches=6, batch_size=8)
    text, cand = plan(cfg, "llama-7b", num_gpus=8, gpu_memory_gb=80, num_nodes=4, seq_len=4096, batch_size=8)
    assert cand.pp == 4 and cand.label == "DDP + PP4" and text.splitlines()[-1].endswith(" --pp_size 4"), text
    assert "  interleaved_1f1b " in text and "bubble 13.6%" in text and "bubble 27.3%" in text
    _, one_node = plan(cfg, "llama-7b", num_gpus=8, gpu_memory_gb=80, seq_len=4096, batch_size=8)
    assert one_node.pp == 1


LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("mixed_precision, tp", [("bf16", 1), ("no", 1), ("bf16", 2)])
def test_chunked_loss_activations_128k_vocab(mixed_precision, tp):
    """The recipe's default chunked LM loss replaces the 4*N*V/t fp32 logits by the head input's gradient (N x H
    fp32) and one chunk of LOGITS_PER_CHUNK // (V/t) tokens: C x V/t x (4 + 2) and the bf16 weight-gradient update
    min(C, H) x V/t x (2 + 4) in bf16 (row blocks), two chunks' fp32 logits in fp32; --loss_chunk_size 0 gives the full
    logits."""
    stats = model_stats(LlamaConfig(**LLAMA3_8B))
    s, b, h, v = 8192, 2, 4096, 128256 // tp
    n = s * b
    kw = dict(seq_len=s, batch_size=b, mixed_precision=mixed_precision, tp_size=tp)
    full = estimate(stats, "fsdp2", 8, loss_chunk_size=0, **kw)["activations"]
    chunked = estimate(stats, "fsdp2", 8, **kw)["activations"]
    body = activation_bytes(
        replace(stats, vocab=0), s, b, tp=tp, act_bytes=2 if mixed_precision == "bf16" else 4, autocast=False
    )  # fsdp2: bf16 weights
    assert full == body + 4 * n * v  # the unchunked figure, as before
    c = LOGITS_PER_CHUNK // v
    assert c == {1: 523, 2: 1046}[tp]
    kept = 4 * n * h + (c * v * 6 + min(c, h) * v * 6 if mixed_precision == "bf16" else 2 * c * v * 4)
    assert chunked == body + kept, (chunked - body, kept)
    assert full - chunked == 4 * n * v - kept and full - chunked > 2**30  # 6.83 / 7.08 / 2.91 GiB less at 16k tokens
    explicit = estimate(stats, "fsdp2", 8, loss_chunk_size=2048, **kw)["activations"]
    assert explicit - chunked == (2048 - c) * v * (12 if mixed_precision == "bf16" else 8)


def test_chunked_loss_off_where_the_recipe_leaves_it_off():
    """Gemma 2 soft-caps its logits after the head (chunked_loss.logits_problem), so the recipe's auto mode
    takes the full logits (the plan too), and an explicit chunk is refused like the recipe's preflight."""
    cfg = Gemma2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=128256,
    )
    auto, off = (estimate(cfg, "ddp", 2, seq_len=4096, loss_chunk_size=c)["activations"] for c in (None, 0))
    assert auto == off
    with pytest.raises(
        PlanError, match="--loss_chunk_size 512: model_type 'gemma2': its logits are not its LM head's output"
    ):
        estimate(cfg, "ddp", 2, loss_chunk_size=512)
    with pytest.raises(PlanError, match=r"^--loss_chunk_size -1: must be >= 1 token, 0 \(off\) or unset \(auto\)$"):
        estimate(LlamaConfig(**LLAMA3_8B), "ddp", 2, loss_chunk_size=-1)


def test_host_ram_per_strategy(tmp_path):
    """Host RAM per rank, as hfpar loads: every rank reads the whole model in fp32 + maps the (bf16) checkpoint
    under DDP / ZeRO-1/2 (6 bytes/param), FSDP2 its dim-0 shard (6/N), TP its slices, ZeRO-3 its fp32 partition
    while rank 0 maps the whole checkpoint; LoRA loads as its base model (FSDP2: shards); offload keeps its CPU
    bytes."""
    d = llama_dir(tmp_path, "m", 4096, 32, 32, 11008)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(d)
    stats = model_stats(config)
    n = stats.n_params
    assert stats.checkpoint_bytes == 2 and model_stats(LlamaConfig(**LLAMA3_8B)).checkpoint_bytes == 4
    host = {s: estimate(config, s, 8)["host"] - HOST_OVERHEAD for s in ("ddp", "zero1", "zero2", "fsdp2", "zero3")}
    assert host["ddp"] == host["zero1"] == host["zero2"] == 6 * n
    assert host["fsdp2"] == pytest.approx(6 * n / 8, abs=1) and host["zero3"] == pytest.approx(4 * n / 8 + 2 * n, abs=1)
    assert host["ddp"] > host["zero3"] > host["fsdp2"]
    tp2 = estimate(config, "ddp", 8, tp_size=2)["host"] - HOST_OVERHEAD
    assert host["ddp"] / 2 < tp2 < host["ddp"] / 2 * 1.01  # half, plus the norms every TP rank holds whole
    assert estimate(config, "fsdp2", 8, lora_rank=16)["host"] - HOST_OVERHEAD == host["fsdp2"]
    assert estimate(config, "ddp", 8, lora_rank=16)["host"] - HOST_OVERHEAD == 6 * n
    pp2 = _pp_worst(stats, 2, 8, seq_len=2048, batch_size=1, mixed_precision="bf16", checkpointing=False)["host"]
    assert host["ddp"] / 2 < pp2 - HOST_OVERHEAD < host["ddp"] * 0.6  # a PP rank reads its stage: about half
    off = estimate(config, "zero3_offload", 8)
    assert off["host"] == HOST_OVERHEAD + max(host["zero3"], off["cpu"]) and off["cpu"] == 16 * n // 8


def test_plan_prints_host_ram_and_loss_chunk(tmp_path, capsys):
    model = llama_dir(tmp_path, "llama-7b", 4096, 32, 32, 11008)
    argv = ["--model", str(model), "--num_gpus", "8", "--gpu_memory_gb", "80", "--seq_len", "4096"]
    out = plan_output(capsys, argv)
    lines = out.splitlines()
    assert lines[3].split()[-2:] == ["host", "fits"] and "chunked LM loss (2097 tokens/chunk" in out
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    for label, strategy in (("DDP ", "ddp"), ("FSDP2 ", "fsdp2"), ("ZeRO-3 ", "zero3")):
        row = next(line for line in lines if line.startswith(label))
        assert row.split()[-2] == f"{estimate(config, strategy, 8, seq_len=4096)['host'] / 2**30:.2f}", row
    assert "DDP + PP2" in out
    chunk = plan_output(capsys, [*argv, "--loss_chunk_size", "1024"])
    assert "DDP + PP" not in chunk and chunk.splitlines()[-1].endswith(" --loss_chunk_size 1024")  # refused with PP
    off = plan_output(capsys, [*argv, "--loss_chunk_size", "0"])
    assert "full fp32 logits (--loss_chunk_size 0)" in off and off.splitlines()[-1].endswith(" --loss_chunk_size 0")


def test_launch_command_on_one_gpu_picks_the_single_config_only_when_nothing_is_sharded():
    """One GPU: DDP without model parallelism becomes single.yaml; a sharding strategy or TP keeps its own config."""
    configs = {
        c: launch_command(c, "m", 1, 1, 128, 1, False, "bf16").split()[3]
        for c in (Candidate("ddp"), Candidate("zero1"), Candidate("fsdp2"), Candidate("ddp", tp=2))
    }
    assert list(configs.values()) == [
        "accelerate_configs/single.yaml",
        "accelerate_configs/zero1.yaml",
        "accelerate_configs/fsdp2.yaml",
        "accelerate_configs/ddp.yaml",
    ], configs


def test_plan_with_lora_recommends_a_run_the_recipes_accept():
    """--lora: the command trains LoRA (--use_peft --lora_r; on a MoE model --lora_dropout 0, which PEFT needs on the
    experts' weights), no row the recipes refuse (EP), and TP's adapters half split (tensor_parallel/lora.py: A whole
    on column layers, B whole on row layers) but for those on MoE routers / experts (whole on every TP rank)."""
    from transformers import Qwen3MoeConfig

    dense = LlamaConfig(**LLAMA3_8B)
    text, _ = plan(dense, "llama-7b", num_gpus=8, gpu_memory_gb=80, lora_rank=16)
    assert text.splitlines()[-1].endswith("--use_peft --lora_r 16") and "--lora_dropout" not in text, text
    one, two = (estimate(dense, "ddp", 8, tp_size=t, lora_rank=16)["grads"] for t in (1, 2))
    assert abs(two / one - 0.75) < 1e-9
    moe = Qwen3MoeConfig(**{**LLAMA3_8B, "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 1024})
    text, _ = plan(moe, "moe", num_gpus=4, gpu_memory_gb=80, lora_rank=16)
    labels = [ln.split("  ")[0] for ln in text.splitlines() if ln.endswith((" yes", " no")) or " yes  +" in ln]
    assert "DDP" in labels and not any("EP" in x for x in labels), labels
    assert "--use_peft --lora_r 16 --lora_dropout 0" in text, text
    stats = model_stats(moe)
    assert 0 < stats.lora_unit_whole < stats.lora_unit
    one, two = (estimate(moe, "ddp", 4, tp_size=t, lora_rank=16)["grads"] for t in (1, 2))
    whole = stats.lora_unit_whole / stats.lora_unit
    assert abs(two / one - (whole + (1 - whole) * 0.75)) < 1e-6
    text, _ = plan(moe, "moe", num_gpus=4, gpu_memory_gb=80, lora_rank=16, tp_size=2)  # accepted (refused before)
    assert "DDP + TP2" in text and "FSDP2 + TP2" in text, text
    with pytest.raises(PlanError, match="--ep_size 2 with --lora: the planned command trains PEFT's all-linear"):
        plan(moe, "moe", num_gpus=4, gpu_memory_gb=80, lora_rank=16, ep_size=2)


def test_pipeline_rows_with_lora_hold_the_stage_adapters():
    """--lora with pipeline stages (was: rows left out, "not estimated"): each stage's grads and optimizer hold the
    adapters of its layers only (its share of rank x (in + out)), its frozen weights as in full training."""
    from hfpar.planner.pipeline import pipeline_estimate

    dense = LlamaConfig(**LLAMA3_8B)
    text, _ = plan(dense, "llama-8b", num_gpus=8, gpu_memory_gb=80, lora_rank=16)
    assert "DDP + PP2" in text and "not estimated" not in text, text
    stats = model_stats(dense)
    whole = estimate(dense, "ddp", 8, lora_rank=16)["grads"]
    full, _ = pipeline_estimate(stats, 2, 8)
    rows, _ = pipeline_estimate(stats, 2, 8, lora_rank=16)
    assert sum(r["layers"] for r in rows) == stats.n_layers
    for r, f in zip(rows, full):
        assert r["grads"] == int(whole * r["layers"] / stats.n_layers) and r["params"] == f["params"]
        assert r["optimizer"] < f["optimizer"] / 50
