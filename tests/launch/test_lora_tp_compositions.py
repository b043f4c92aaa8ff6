"""LoRA with TP=2 composed with pipeline (pp 2, interleaved 1F1B) and context (cp 2) parallelism on 4 processes (dp 1,
global batch 8), against one process: loss and grad norm per step and the exported adapter within the parity
tolerance. On demand (-m extended: launches of 4 processes on 2 cores, over the suite's budget); each case records its
figures in benchmarks/results/lora/tp_compositions_cpu.json (2026-11-30: loss / grad norm within 1.0e-7 / 1.1e-7 for
tp2 x pp2 and tp2 x cp2, adapters within 1.9e-6 / 2.5e-6). A tiny Qwen3-MoE with adapters on q / v under TP=2 x
EP=2 (dp 2) against its one-process LoRA run, the same way (refused before 2026-11-30).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.helpers.ep_models import save_tiny_moe
from tests.helpers.launch import launch_all, read_metrics
from tests.helpers.parity import TOL, assert_close_series
from tests.helpers.results import record
from tests.launch.test_lora import LORA

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.extended]

PP = ["--pp_size", "2", "--pp_schedule", "interleaved_1f1b", "--pp_microbatches", "4"]
MOE = ["--model_name_or_path", "<moe>", "--lora_target_modules", "q_proj,v_proj"]  # adapters outside the experts
RUNS = {
    "single": ("single", 1, []),
    "tp2pp2": ("ddp", 4, ["--tp_size", "2", *PP]),
    "tp2cp2": ("ddp", 4, ["--tp_size", "2", "--cp_size", "2"]),
    # a tiny Qwen3-MoE: TP=2 x EP=2 (dp 2: the experts split over the two data-parallel ranks of each TP rank)
    "moe_single": ("single", 1, MOE),
    "moe_tp2ep2": ("ddp", 4, [*MOE, "--tp_size", "2", "--ep_size", "2", "--per_device_train_batch_size", "2"]),
}
REFERENCE = {"tp2pp2": "single", "tp2cp2": "single", "moe_tp2ep2": "moe_single"}


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_tp")
    out = {name: root / name for name in RUNS}
    moe = save_tiny_moe("qwen3_moe", root / "moe_model")
    args = [*LORA, "--model_name_or_path", base_model, "--per_device_train_batch_size", "4"]
    launch_all(
        {
            n: (cfg, nproc, "sft", [*args, *[moe if a == "<moe>" else a for a in extra], "--output_dir", str(out[n])])
            for n, (cfg, nproc, extra) in RUNS.items()
        }
    )
    return out


@pytest.mark.parametrize("name", REFERENCE)
def test_lora_tp_composition_matches_single(runs, name):
    ref, _ = read_metrics(runs[REFERENCE[name]])
    got, _ = read_metrics(runs[name])
    assert len(got) == 8
    assert_close_series(ref, got, "loss", TOL, name)
    assert_close_series(ref, got, "grad_norm", TOL, name)
    a, b = (load_file(str(runs[n] / "adapter_model.safetensors")) for n in (REFERENCE[name], name))
    rel = lambda x, y: abs(x - y) / max(abs(x), abs(y), 1e-12)
    record(
        "lora/tp_compositions_cpu",
        f"{name} (4 processes) max relative diff (per step loss / grad_norm, adapter) against {REFERENCE[name]}",
        {
            **{k: max(rel(r[k], g[k]) for r, g in zip(ref, got)) for k in ("loss", "grad_norm")},
            "adapter": max(float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) for k in a),
        },
        command="python -m pytest -q -m extended tests/launch/test_lora_tp_compositions.py",
    )
    assert a.keys() == b.keys()
    assert all((a[k] - b[k]).norm() <= 1e-4 * a[k].norm().clamp(min=1e-12) for k in a), name
