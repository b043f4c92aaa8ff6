"""Sharded loading through the recipe on a real-size model: host memory per rank, and the same training result.

    python -m pytest -q -s tests/launch/test_loading_recipe.py      # 6 launches, two at a time: 2:43 on 2 busy cores

A random-init Llama of 106M parameters (hidden 768, 8 layers, intermediate 2048, vocab 32000, untied; 423 MiB
fp32) saved as one model.safetensors in a temp dir with the repo's tokenizer. sft recipe, 2 processes, fp32,
2 optimizer steps, batch 2 x seq 64, no eval, no checkpoints, final export on:
  fsdp2.yaml                         sharded (each rank reads its FSDP2 dim-0 shards)  and  --sharded_loading false
  ddp.yaml --tp_size 2               sharded (each rank reads its TP slices)           and  --sharded_loading false
  the saved tiny base model (tests/helpers/parity.py) under each of the two, same flags: the baseline.

What is asserted, and why not the issue's literal figure. The issue's acceptance reads: each rank's
`host_peak_rss_bytes_per_rank` minus the tiny baseline's <= 0.65 x the model's fp32 bytes. That field is the peak
of the whole run, and the whole run cannot meet 0.65x by construction: after loading, each rank of a 2-way
FSDP2 or TP run holds half the parameters, their gradients and two fp32 Adam moments, 0.5 x 4 = 2x the model's
bytes (run_info: param 202 + grad 202 + optimizer 404 MiB per rank). Measured whole-run peaks above the baseline
(benchmarks/results/loading/recipe_cpu.json, which this test writes): FSDP2 4.4-4.9x sharded, 4.3-4.4x full load;
TP 3.2x sharded, 3.9-4.0x full load: training (gathered root parameters, unsharded gradients before the
reduce-scatter, the allocator's retained pages), not loading, sets that peak. So the 0.65x bound is asserted on the
loading peak, `host_peak_rss_after_load_bytes_per_rank` (ru_maxrss once the model is loaded and wrapped), minus the
baseline's same figure; the full-load runs are asserted to exceed it (the measure sees a whole model held on a rank).
Measured: FSDP2 0.62x sharded against 1.11x full; TP 0.62x sharded against 2.3-2.5x full (a rank's half, 0.5x,
plus one tensor in flight and the allocator's slack). The baseline's own peak is set by start-up (imports, data:
~500 MiB), so the difference is the growth beyond that peak. hfpar.loading.files copies each box it reads out of
the file's mmap and closes the map per tensor: safetensors returns a contiguous range as a view of its mmap, and
before the copy the FSDP2 shards were views paged in on first use (0.005x at this point, growing in training),
the parameters tied to the checkpoint file staying unchanged; with the map held for the whole load, the pages
read counted on top of the copies (1.1x).

The trained result: each sharded run's exported weights equal its full-load run's within 1e-6 (max abs; measured 0).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import launch_all, read_run_info
from tests.helpers.results import record

pytestmark = pytest.mark.slow

CONFIG = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    tie_word_embeddings=False,
)
FLAGS = [
    "--max_steps",
    "2",
    "--eval_steps",
    "0",
    "--max_seq_length",
    "64",
    "--logging_steps",
    "1",
    "--per_device_train_batch_size",
    "2",
]
STRATEGIES = {"fsdp2": ("fsdp2", []), "tp2": ("ddp", ["--tp_size", "2"])}  # name: (accelerate config, flags)
LOAD_BOUND = 0.65  # x the model's fp32 bytes (the acceptance)
WEIGHT_TOL = 1e-6
MIB = 2**20


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hfpar import data

    path = tmp_path_factory.mktemp("llama106m")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert n >= 100_000_000, n
    return str(path), n


@pytest.fixture(scope="module")
def runs(big_model, base_model, tmp_path_factory) -> dict:
    """{(strategy, variant): output dir}; variant sharded | full | baseline (the tiny model), two launches at a
    time (two big ones together hold ~9 GiB: 2 x 2 ranks x ~2.3 GiB peak)."""
    root = tmp_path_factory.mktemp("loading_recipe")
    jobs, outs = {}, {}
    for name, (config, extra) in STRATEGIES.items():
        for variant, model, more in (
            ("sharded", big_model[0], []),
            ("baseline", base_model, []),
            ("full", big_model[0], ["--sharded_loading", "false"]),
        ):
            outs[(name, variant)] = root / f"{name}_{variant}"
            jobs[f"{name}_{variant}"] = (
                config,
                2,
                "sft",
                [*FLAGS, *extra, *more, "--model_name_or_path", model, "--output_dir", str(outs[(name, variant)])],
            )
    launch_all(jobs, group=False, fresh=True)  # each run measures its own peak RSS: a fresh interpreter each
    return outs


def _mib(values) -> list[float]:
    return [round(v / MIB, 1) for v in values]


def test_each_rank_loads_at_most_065x_of_the_model(big_model, runs):
    """Per rank: loading peak RSS (after load + wrap) minus the tiny baseline's <= 0.65 x fp32 model bytes when
    sharded; the full-load run of the same strategy is above the bound (the measure sees a whole model)."""
    n = big_model[1]
    model_bytes = 4 * n
    table, problems = {}, []
    for name in STRATEGIES:
        info = {v: read_run_info(runs[(name, v)]) for v in ("sharded", "full", "baseline")}
        assert info["sharded"]["loading"]["mode"] == ("fsdp2" if name == "fsdp2" else "sharded"), info["sharded"]
        assert info["full"]["loading"] == {"mode": "full", "why": "--sharded_loading false"}, info["full"]["loading"]
        row = {}
        for field, short in (
            ("host_peak_rss_after_load_bytes_per_rank", "load"),
            ("host_peak_rss_bytes_per_rank", "run"),
        ):
            base = info["baseline"][field]
            for v in ("sharded", "full"):
                delta = [a - b for a, b in zip(info[v][field], base)]
                row[f"{short}_{v}_minus_baseline_mib"] = _mib(delta)
                row[f"{short}_{v}_x_model"] = [round(d / model_bytes, 3) for d in delta]
            row[f"{short}_baseline_mib"] = _mib(base)
        for key in ("param_bytes_per_rank", "grad_bytes_per_rank", "optimizer_state_bytes_per_rank"):
            row[key.replace("bytes", "mib")] = _mib(info["sharded"][key])
        table[name] = row
        print(f"LOADING-RECIPE {name}: {row}")
        if not all(x <= LOAD_BOUND for x in row["load_sharded_x_model"]):
            problems.append(f"{name} sharded: load peak - baseline = {row['load_sharded_x_model']} x model bytes")
        if not all(x > LOAD_BOUND for x in row["load_full_x_model"]):
            problems.append(f"{name} full load: {row['load_full_x_model']} x model bytes, not above the bound")
    record(
        "loading/recipe_cpu",
        "llama_106M_2proc",
        {"num_parameters": n, "model_fp32_mib": round(model_bytes / MIB, 1), **table},
        command="python -m pytest -q -s tests/launch/test_loading_recipe.py",
    )
    assert not problems, "\n".join(problems)


def test_sharded_load_trains_like_the_full_load(big_model, runs):
    """2 optimizer steps from either load: the exported weights agree within 1e-6 (max abs), and training
    moved them (the comparison is not between two untouched copies of the checkpoint)."""
    initial = load_file(f"{big_model[0]}/model.safetensors")
    for name in STRATEGIES:
        got = load_file(str(runs[(name, "sharded")] / "model.safetensors"))
        ref = load_file(str(runs[(name, "full")] / "model.safetensors"))
        assert got.keys() == ref.keys() == initial.keys(), name
        diff = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        moved = max(float((ref[k] - initial[k]).abs().max()) for k in ref)
        print(f"LOADING-RECIPE {name}: max |sharded - full| {diff:.2e}, max |trained - initial| {moved:.2e}")
        assert diff <= WEIGHT_TOL, (name, diff)
        assert moved > 1e-4, (name, moved)
