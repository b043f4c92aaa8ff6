"""`hfpar plan`'s estimator against bytes measured in real 2-process runs; and `hfpar export` / `hfpar plot` on the
checkpoints and metrics of the same runs (one launch per strategy). Recommendations, byte accounting and errors from
a config alone: tests/unit/test_planner.py.

    python -m pytest -q tests/launch/test_plan.py
"""

from __future__ import annotations

import pytest
import torch

from hfpar import data
from hfpar.cli import main as cli
from hfpar.planner.table import estimate
from tests.helpers.launch import read_run_info
from tests.helpers.results import record

STRATEGIES = ("ddp", "fsdp2", "zero3")
TOL = 0.10  # estimator vs measured, per rank and category


@pytest.fixture(scope="module")
def runs(backend_runs) -> dict:
    """The fp32 2-process backend runs of the parity tests (embedded tiny Llama, checkpoints at 4 and 8)."""
    return {s: backend_runs[s] for s in STRATEGIES}


def measured(run) -> dict[str, list[int]]:
    info = read_run_info(run)
    return {
        "params": info["param_bytes_per_rank"],
        "grads": info["grad_bytes_per_rank"],
        "optimizer": info["optimizer_state_bytes_per_rank"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_estimate_matches_measured_bytes(runs, strategy):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(data.embedded_model_path())
    est = estimate(config, strategy, 2, mixed_precision="no")
    got = measured(runs[strategy])
    record(
        "planner/estimate_cpu",
        strategy,
        {
            cat: {
                "estimated": est[cat],
                "measured_per_rank": got[cat],
                "max_relative_error": max(abs(est[cat] - b) / b for b in got[cat]),
            }
            for cat in ("params", "grads", "optimizer")
        },
        command="python -m pytest -q tests/launch/test_plan.py -k estimate",
    )
    for cat in ("params", "grads", "optimizer"):
        for rank, b in enumerate(got[cat]):
            err = abs(est[cat] - b) / b
            print(f"{strategy} {cat} rank {rank}: estimated {est[cat]:,} measured {b:,} error {err:.2%}")
            assert err <= TOL, f"{strategy} {cat} rank {rank}: estimated {est[cat]:,} vs measured {b:,} ({err:.1%})"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_checkpoint_gives_the_final_model(runs, strategy, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = runs[strategy] / "checkpoint-8"  # the final step: equal to the final model
    assert (ckpt / "config.json").is_file(), "save_checkpoint writes the model config next to the state"
    cli(["export", str(ckpt), str(tmp_path / "hf")])
    x = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(runs[strategy], dtype=torch.float32).eval()(x).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(x).logits
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert torch.allclose(got, ref, rtol=0, atol=1e-5), f"{strategy}: max diff {(got - ref).abs().max():.2e}"


@pytest.mark.slow
def test_plot_overlays_runs(runs, tmp_path, capsys):
    cli(["plot", *(str(runs[s]) for s in STRATEGIES), "-o", str(tmp_path / "runs.png")])
    png = tmp_path / "runs.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
