"""The parity contract for the data-parallel backends, end to end through `accelerate launch`.

fp32, sft recipe, tiny Llama, 8 optimizer steps, global batch 8:
  single: 1 process x batch 4 x accumulation 2
  ddp / fsdp2 / zero2 / zero3 (/ zero1: on demand, -m extended): 2 gloo processes x batch 2 x accumulation 2
Each must match `single` per step (loss, grad_norm) and in the exported weights within 1e-4
relative (and within UPDATE_TOL of the training update, ||got - ref|| / ||ref - base||); the export must load with
from_pretrained and reproduce the trainer's eval loss; run_info.json must name the strategy really used and show the
sharding in per-rank bytes; every run uses the default padding-free batches (tests/unit/test_padding_free.py: the same
as padded ones); resuming from checkpoint-4 must reproduce steps 5..8. Launches are shared between assertions.
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import read_metrics, read_run_info, rel_close
from tests.helpers.parity import (
    BACKENDS,
    EXTENDED_BACKENDS,
    RESUMED_BACKENDS,
    TOL,
    assert_close_series,
    assert_export_matches,
    assert_resumed_like_uninterrupted,
    assert_steps_match,
    export_eval_loss,
    launch_cases,
)
from tests.helpers.planting import assert_no_planted_payload_runs, assert_reads_in_both_pickle_forms

pytestmark = pytest.mark.slow

STRATEGIES = BACKENDS


@pytest.fixture(scope="module")
def runs(backend_runs):
    return backend_runs


def test_single_reference_learns(runs):
    train, evals = read_metrics(runs["single"])
    assert len(train) == 8 and evals, "single run must log 8 steps and a final eval"
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(r["num_target_tokens"] > 0 for r in train)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_step_loss_and_grad_norm_match_single(runs, strategy):
    ref, _ = read_metrics(runs["single"])
    got, _ = read_metrics(runs[strategy])
    assert len(got) == 8
    assert_close_series(ref, got, "loss", TOL, strategy)
    assert_close_series(ref, got, "grad_norm", TOL, strategy)
    # the same global batch: identical target-token counts per step
    assert [r["num_target_tokens"] for r in ref] == [r["num_target_tokens"] for r in got]


@pytest.fixture(scope="module")
def extended_runs(base_model, tmp_path_factory):
    cases = {name: (name, 2, "2", []) for name in EXTENDED_BACKENDS}
    return launch_cases(cases, base_model, tmp_path_factory.mktemp("backends_extended"))


@pytest.mark.extended  # on demand (-m extended, docs/testing.md)
@pytest.mark.parametrize("strategy", EXTENDED_BACKENDS)
def test_extended_backends_match_single(extended_runs, single_run, strategy, base_weights):
    assert_steps_match(single_run, extended_runs[strategy], strategy)
    assert_export_matches(single_run, extended_runs[strategy], strategy, initial=base_weights)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exported_weights_match_single(runs, strategy, base_weights):
    assert_export_matches(runs["single"], runs[strategy], strategy, initial=base_weights)


@pytest.mark.parametrize("strategy", ["single", *STRATEGIES])
def test_export_loads_and_reproduces_eval_loss(runs, strategy):
    """from_pretrained on one process gives the trainer's final eval loss (same logits)."""
    _, evals = read_metrics(runs[strategy])
    assert rel_close(export_eval_loss(runs[strategy]), evals[-1]["eval_loss"], 1e-4)


@pytest.mark.parametrize("strategy", ["single", *STRATEGIES])
def test_run_info_names_the_strategy_and_shows_sharding(runs, strategy):
    info = read_run_info(runs[strategy])
    ref = read_run_info(runs["single"])
    assert info["strategy"] == strategy.replace("_offload", "")
    assert info["padding_free"] is True  # the default batching: each micro-batch's samples packed into rows
    assert info["world_size"] == (1 if strategy == "single" else 2)
    full = ref["param_bytes_per_rank"][0]
    assert full == 4 * info["num_parameters"]  # fp32
    per_rank = info["param_bytes_per_rank"]
    if strategy in ("fsdp2", "zero3", "zero3_offload"):  # parameters sharded: about half on each rank
        assert all(abs(b / full - 0.5) < 0.05 for b in per_rank), per_rank
        assert abs(sum(per_rank) / full - 1) < 0.05
    else:  # replicated parameters
        assert per_rank == [full] * info["world_size"]
    opt = info["optimizer_state_bytes_per_rank"]
    opt_full = ref["optimizer_state_bytes_per_rank"][0]
    if strategy != "ddp" and strategy != "single":  # optimizer state partitioned
        assert all(abs(b / opt_full - 0.5) < 0.05 for b in opt), (opt, opt_full)
    else:
        assert opt == [opt_full] * info["world_size"]


@pytest.mark.parametrize("strategy", RESUMED_BACKENDS)
def test_resume_reproduces_remaining_steps(runs, strategy):
    """Each backend's run resumed from its checkpoint-4 in a fresh output dir (in the runs' launch: conftest)."""
    src, out = runs[strategy], runs[f"{strategy}/resumed"]
    ref, _ = read_metrics(src)
    got, _ = read_metrics(out)
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    assert_close_series(ref[4:], got, "loss", 1e-6, f"{strategy} resumed")
    assert_close_series(ref[4:], got, "grad_norm", 1e-6, f"{strategy} resumed")
    assert_resumed_like_uninterrupted(src, out, strategy)


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_a_planted_pickle_never_runs(runs, strategy, tmp_path):
    """Each file of an FSDP2 (DCP) / ZeRO checkpoint replaced by a pickle payload, manifest re-signed: every reader a
    resume or an export uses refuses it in one line, no payload runs (tests/helpers/planting.py); export too."""
    assert assert_no_planted_payload_runs(runs[strategy] / "checkpoint-4", tmp_path, export=True) >= 6
    # the same files with their enum members pickled by name (the CUDA build's form): still read (#37)
    assert assert_reads_in_both_pickle_forms(runs[strategy] / "checkpoint-4", tmp_path) >= 1
