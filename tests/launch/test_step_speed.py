"""The two speed options change no number of a run: the prefetching loader (--dataloader_prefetch_factor, on by
default: every other launch test runs with it) and regional compilation (--torch_compile), one process.

    python -m pytest -q -s tests/launch/test_step_speed.py

Against the session's single-process reference (tests/conftest.py single_run: the parity flags, 8 steps, prefetch on),
in ONE launch of three runs (tests/helpers/recipe_runs.py):
  prefetch_off  the same run with --dataloader_prefetch_factor 0: every step's loss, grad norm and target tokens
                EQUAL (the rows of a step and their order do not depend on the loader)
  resumed       the reference resumed from its checkpoint-4 (prefetch on): steps 5-8 and the final weights as
                uninterrupted (batches loaded ahead of the checkpoint are not counted as consumed)
  compiled      --torch_compile --torch_compile_backend aot_eager: per step and exported weights within the parity
                contract's 1e-4 (TOL) of the eager run; measured: identical on this machine (aot_eager runs the same
                aten ops as eager, traced); its run_info.json names the compiled blocks and the compile time.
aot_eager, not inductor, for the suite's budget: inductor compiles C++ with g++ (present here) but takes minutes of
CPU under the suite's load; its parity is measured in docs/recipes.md ("Speed").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launch import launch_all, read_metrics, read_run_info
from tests.helpers.parity import COMMON, assert_export_matches, assert_resume_from_step_4, assert_steps_match
from tests.helpers.shared import built_once

COMPILE = ["--torch_compile", "--torch_compile_backend", "aot_eager"]


@pytest.fixture(scope="module")
def runs(base_model, single_run, tmp_path_factory):
    def build(root):
        common = [*COMMON, "--model_name_or_path", base_model, "--per_device_train_batch_size", "4"]
        outs = {name: root / name for name in ("prefetch_off", "resumed", "compiled")}
        jobs = {
            "prefetch_off": ("single", 1, "sft", [*common, "--dataloader_prefetch_factor", "0"]),
            "resumed": ("single", 1, "sft", [*common, "--resume_from_checkpoint", "latest"]),
            "compiled": ("single", 1, "sft", [*common, *COMPILE, "--save_steps", "0"]),
        }
        jobs = {k: (*v[:3], [*v[3], "--output_dir", str(outs[k])]) for k, v in jobs.items()}
        jobs["resumed"] = (*jobs["resumed"], (single_run / "checkpoint-4", outs["resumed"] / "checkpoint-4"))
        launch_all(jobs)
        return {k: str(v) for k, v in outs.items()}

    return {"single": single_run, **{k: Path(v) for k, v in built_once(tmp_path_factory, "step_speed", build).items()}}


def test_prefetch_changes_no_step(runs):
    ref, _ = read_metrics(runs["single"])
    got, _ = read_metrics(runs["prefetch_off"])
    keys = ("step", "loss", "grad_norm", "num_target_tokens", "lr")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in ref]


def test_resume_with_prefetch_is_exact(runs, base_model, tmp_path):
    """Steps 5-8 and the final weights within 1e-6 of the uninterrupted run (the resume tests' bound)."""
    case = ("single", 1, "4", [])
    assert_resume_from_step_4(case, runs["single"], base_model, tmp_path, "prefetch", resumed=runs["resumed"])


def test_compiled_run_matches_eager(runs, base_weights):
    assert_steps_match(runs["single"], runs["compiled"], "compiled (aot_eager)")
    assert_export_matches(runs["single"], runs["compiled"], "compiled (aot_eager)", initial=base_weights)
    info = read_run_info(runs["compiled"])["torch_compile"]
    assert info["backend"] == "aot_eager" and info["regions"] == 4 and info["region"] == "LlamaDecoderLayer"
    assert info["compile_s"] > 0
    train, _ = read_metrics(runs["compiled"])
    assert train[-1]["compile_s"] == info["compile_s"]
