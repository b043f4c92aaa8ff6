"""Pipeline parallelism end to end (`--pp_size` through the sft recipe under ddp / fsdp2 / zero1), parity contract.

fp32, 8 steps, global batch 8 vs the single-process run: pp=2 with GPipe and with 1F1B (2 processes), pp=2 with
activation checkpointing and an uneven manual split (--pp_split 0,1), pp=2 x dp=2, pp=2 x tp=2 with sequence
parallelism (ddp.yaml); interleaved 1F1B (2 chunks of 1 layer per rank: virtual stages r and r + 2) with tp=2 and
sequence parallelism (ddp.yaml), and with dp=2 under fsdp2.yaml and under zero1.yaml (4 processes); pp=4 and pp=2 x
dp=2 x tp=2 under fsdp2.yaml (8 processes) in the extended tier (CI time): per-step
loss and grad_norm within 1e-4, exported weights within 1e-4 (and relative to the training update), the export
reloads with from_pretrained and reproduces the final eval loss. Resume under pp=2 x tp=2 and under pp=2 x FSDP2
reproduces steps 5-8; the pp=2 checkpoint resumed on one process and under tp=2 (its full form) continues the
same training, and `hfpar export` of pipeline checkpoints equals the final export. Tied input / output embeddings (first
and last stage each hold the weight) at pp=2 against their own single-process run. LoRA with pp=2 is in
tests/launch/test_lora.py (its single-process LoRA reference).

EP=2 x PP=2 (4 processes: dp 2, the experts of each stage split over its 2 dp ranks) of the tiny Llama upcycled to 4
experts (top-2, aux loss 0.1): interleaved 1F1B under fsdp2.yaml (1F1B under ddp.yaml: extended tier), against the same
upcycled model in one process. Routing statistics (aux loss, padding mask) are per pipeline micro-batch (1 row of each
dp rank here), so the reference runs micro-steps of that size: batch 2 x accumulation 4 (the sampler makes micro-batch i
of the dp ranks one contiguous slice of the global batch, the rows of one reference micro-step). Per step loss and
grad_norm (aux-loss gradient included) within 1e-4, the export (a Mixtral checkpoint) within 1e-4 and reloadable.
Extended tier (-m extended, on demand: each 4-process launch costs about as much as this suite's pp2_dp2 one):
EP=2 x PP=2 under 1F1B over ddp.yaml and over zero1.yaml (per step, export, resume of steps 5-8), PP=2 x CP=2 (4
processes, dp 1; each stage's attention context-parallel, each micro-batch with its rows' layout) with ring under
ddp.yaml and fsdp2.yaml and Ulysses under zero1.yaml, and PP=2 x TP=2 under zero1.yaml (with sequence parallelism at
dp 1, and at dp 2 on 8 processes), against single (tests/unit/test_pipeline_micro_scope.py checks the per-micro-batch
layouts in CI).
A pipeline with two or
three other model parallelisms, a 1F1B case per key (extended tier): pp=2 x tp=2 (sequence parallel) x cp=2 ring (8
processes, dense, against single); and against moe_single: EP=4 x CP=2 x PP=2 under fsdp2.yaml (dp 2: experts drawn
from dp x cp), TP=2 x EP=2 x PP=2 under fsdp2.yaml (dp 2), TP=2 x EP=2 x CP=2 x PP=2 (dp 1, experts drawn from the
cp ranks); and EP=2 x CP=2 x PP=2 with Ulysses under interleaved 1F1B (4 processes); each with its export (reloaded)
and its checkpoint's export.
"""

from __future__ import annotations

import pytest

from hfpar.checkpoint.export import ExportError, export_checkpoint
from tests.helpers.launch import read_metrics, read_run_info, rel_close
from tests.helpers.parity import (
    TOL,
    assert_checkpoint_exports_final,
    assert_close_series,
    assert_continues_uninterrupted,
    assert_export_matches,
    assert_resume_from_step_4,
    assert_steps_match,
    export_eval_loss,
    launch_cases,
    resume_on_other_meshes,
)
from tests.helpers.planting import assert_no_planted_payload_runs, assert_reads_in_both_pickle_forms
from tests.helpers.pp_cases import CASES, EXTENDED, MOE_CASES, MULTI

pytestmark = pytest.mark.slow

RESUMED = ("pp2_tp2_sp", "pp2_interleaved_dp2_fsdp2", "pp2_interleaved_tp2_sp")  # resumed in the cases' launches


@pytest.fixture(scope="module")
def pp_runs(base_model, tmp_path_factory):
    return launch_cases({**CASES, **MOE_CASES}, base_model, tmp_path_factory.mktemp("pp"), resume=RESUMED)


@pytest.mark.parametrize("case", list(CASES))
def test_pp_matches_single_per_step(pp_runs, single_run, case):
    ref, ref_eval = read_metrics(single_run)
    got, got_eval = read_metrics(pp_runs[case])
    assert len(got) == 8
    assert_close_series(ref, got, "loss", TOL, case)
    assert_close_series(ref, got, "grad_norm", TOL, case)
    assert [r["num_target_tokens"] for r in ref] == [r["num_target_tokens"] for r in got]
    assert_close_series(ref_eval, got_eval, "eval_loss", TOL, case)


def test_pp_ranks_read_only_their_stage(pp_runs, base_weights):
    """No launch of its own: every pipeline run loaded sharded, rank 0 (first stage) reading under 3/4 of the
    checkpoint (about half: its layers and the embedding; a quarter at pp=4 or with tp=2)."""
    whole = sum(t.numel() * t.element_size() for t in base_weights.values())
    for case in CASES:
        load = read_run_info(pp_runs[case])["loading"]
        assert load["mode"] == "sharded" and "pipeline stage" in load["why"], (case, load)
        assert 0 < load["bytes_read"] < 0.75 * whole, (case, load["bytes_read"], whole)


@pytest.mark.parametrize("case", list(CASES))
def test_pp_export_matches_single_and_reloads(pp_runs, single_run, base_weights, case):
    assert_export_matches(single_run, pp_runs[case], case, initial=base_weights)
    _, evals = read_metrics(pp_runs[case])
    assert rel_close(export_eval_loss(pp_runs[case]), evals[-1]["eval_loss"], 1e-4)
    info = read_run_info(pp_runs[case])
    pp = int(CASES[case][3][1])
    flags = CASES[case][3]
    schedule = flags[flags.index("--pp_schedule") + 1] if "--pp_schedule" in flags else "1f1b"
    assert info["pp_size"] == pp and info["pp_schedule"] == schedule and info["pp_microbatches"] >= 1
    stages = info["pp_stage_layers"]
    if schedule == "interleaved_1f1b":  # per rank its chunks [start, stop]: rank r holds virtual stages r, r + pp
        assert info["pp_virtual_stages"] == 2 and stages == [[[0, 1], [2, 3]], [[1, 2], [3, 4]]]
        return
    assert len(stages) == pp and stages[0][0] == 0 and stages[-1][1] == 4
    assert all(a < b and b == c for (a, b), (c, _) in zip(stages, stages[1:] + [(4, None)]))
    if case == "pp2_checkpointing_split":
        assert stages == [[0, 1], [1, 4]]


@pytest.mark.parametrize("case", RESUMED)
def test_pp_resume_reproduces_remaining_steps(pp_runs, base_model, tmp_path, case):
    """Per-rank states: TP-sharded stages (the plain pipeline's layout, with shards), FSDP2's DTensor chunks, and
    TP-sharded interleaved chunks (each rank's two chunks in one state)."""
    assert_resume_from_step_4(CASES[case], pp_runs[case], base_model, tmp_path, case, pp_runs[f"{case}/resumed"])


@pytest.fixture(scope="module")
def pp_resharded(pp_runs, base_model, tmp_path_factory) -> dict:
    """The pp=2 (1F1B) checkpoint resumed without a pipeline: on one process, and tensor-parallel on 2."""
    cases = {
        "pp2_to_pp1": (pp_runs["pp2_1f1b"], ("single", 1, "4", [])),
        "pp2_to_tp2": (pp_runs["pp2_1f1b"], ("ddp", 2, "4", ["--tp_size", "2"])),
    }
    return resume_on_other_meshes(cases, base_model, tmp_path_factory.mktemp("pp_resharded"))


@pytest.mark.parametrize("case", ["pp2_to_pp1", "pp2_to_tp2"])
def test_pp_resumes_on_another_mesh(pp_resharded, pp_runs, base_weights, case):
    """Each stage's pieces (its layers renamed to the full model's) joined into full tensors, cut for the new mesh."""
    assert_continues_uninterrupted(pp_runs["pp2_1f1b"], pp_resharded[case], case, initial=base_weights)


@pytest.mark.parametrize("case", ["pp2_1f1b", "pp2_interleaved_tp2_sp", "pp2_tp2_sp", "pp2_interleaved_dp2_fsdp2"])
def test_pp_checkpoint_export_equals_the_final_export(pp_runs, tmp_path, case):
    assert_checkpoint_exports_final(pp_runs[case], tmp_path, case)


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    """The embedded tiny Llama with tied input / output embeddings: one process and pp=2 (the weight on the first
    and the last stage, its grads summed over the two)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar import data

    path = tmp_path_factory.mktemp("tied_base")
    cfg = AutoConfig.from_pretrained(data.embedded_model_path())
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    cases = {"tied_single": ("single", 1, "4", []), "tied_pp2": ("ddp", 2, "4", ["--pp_size", "2"])}
    return launch_cases(cases, str(path), tmp_path_factory.mktemp("tied"))


def test_pp_tied_embeddings_match_single(tied_runs):
    ref, ref_eval = read_metrics(tied_runs["tied_single"])
    got, got_eval = read_metrics(tied_runs["tied_pp2"])
    assert len(got) == 8
    for key in ("loss", "grad_norm"):
        assert_close_series(ref, got, key, TOL, "tied pp2")
    assert_close_series(ref_eval, got_eval, "eval_loss", TOL, "tied pp2")
    assert_export_matches(tied_runs["tied_single"], tied_runs["tied_pp2"], "tied pp2")
    assert rel_close(export_eval_loss(tied_runs["tied_pp2"]), got_eval[-1]["eval_loss"], 1e-4)


@pytest.mark.parametrize("case", ["pp2_interleaved_dp2_fsdp2", "pp2_interleaved_dp2_zero1"])
def test_pp_planted_pickle_never_runs(pp_runs, case, tmp_path):
    """Per-stage files (FSDP2) / DeepSpeed's stage files (ZeRO-1) each replaced by a pickle payload: refused, never
    run."""
    assert assert_no_planted_payload_runs(pp_runs[case] / "checkpoint-4", tmp_path) >= 6
    assert_reads_in_both_pickle_forms(pp_runs[case] / "checkpoint-4", tmp_path)  # raises where a reader refuses (#37)


def _assert_ep_pp_matches(ref_dir, got_dir, case: str, tmp_path, exports_checkpoint: bool = True) -> None:
    """Experts split over the dp ranks of each stage, routed per micro-batch; the export is the upcycled model's
    Mixtral checkpoint (experts gathered from both EP ranks of both stages), equal and reloadable, and `hfpar
    export` of the last checkpoint (the stages' config: the Mixtral one) writes the same."""
    ref_eval, got_eval = read_metrics(ref_dir)[1], read_metrics(got_dir)[1]
    assert_steps_match(ref_dir, got_dir, case)  # loss, grad_norm, target tokens per step (8 steps)
    assert_close_series(ref_eval, got_eval, "eval_loss", TOL, case)
    assert_export_matches(ref_dir, got_dir, case)
    assert rel_close(export_eval_loss(got_dir), got_eval[-1]["eval_loss"], 1e-4)
    info = read_run_info(got_dir)
    sizes = _sizes(case)
    assert {k: info[k] for k in sizes} == sizes, info
    two, one = info["param_bytes_per_rank"], read_run_info(ref_dir)["param_bytes_per_rank"][0]
    assert len(two) == sizes["world_size"] and all(b < one / 2 for b in two), (
        one,
        two,
    )  # half the layers, fewer experts
    if exports_checkpoint:
        assert_checkpoint_exports_final(got_dir, tmp_path, case)


def _sizes(case: str) -> dict:
    """The degrees a case's flags ask for (dp: what the processes leave), as run_info.json records them."""
    _, nproc, _, flags = {**CASES, **MOE_CASES, **EXTENDED}[case]
    sizes = {
        f"{d}_size": int(flags[flags.index(f"--{d}_size") + 1]) if f"--{d}_size" in flags else 1
        for d in ("tp", "ep", "cp", "pp")
    }
    return {**sizes, "world_size": nproc, "dp_size": nproc // (sizes["tp_size"] * sizes["cp_size"] * sizes["pp_size"])}


def test_ep_pp_interleaved_fsdp2_matches_single_per_step_and_export(pp_runs, tmp_path):
    _assert_ep_pp_matches(
        pp_runs["moe_single"], pp_runs["ep2_pp2_interleaved_fsdp2"], "ep2_pp2_interleaved_fsdp2", tmp_path
    )


@pytest.fixture(scope="module")
def extended_runs(base_model, tmp_path_factory):
    return launch_cases(EXTENDED, base_model, tmp_path_factory.mktemp("pp_extended"))


@pytest.mark.extended
def test_ep_pp_1f1b_ddp_matches_single_per_step_and_export(extended_runs, tmp_path):
    _assert_ep_pp_matches(extended_runs["moe_single"], extended_runs["ep2_pp2_1f1b"], "ep2_pp2_1f1b", tmp_path)


@pytest.mark.extended
def test_ep_pp_zero1_matches_single_per_step_export_and_resume(extended_runs, base_model, tmp_path):
    from hfpar.checkpoint.export import ExportError, export_checkpoint

    _assert_ep_pp_matches(
        extended_runs["moe_single"], extended_runs["ep2_pp2_zero1"], "ep2_pp2_zero1", tmp_path, exports_checkpoint=False
    )
    # EP x DeepSpeed checkpoints have no full form (as without a pipeline): `hfpar export` refuses them in one line
    with pytest.raises(ExportError, match="which has no full form"):
        export_checkpoint(extended_runs["ep2_pp2_zero1"] / "checkpoint-8", tmp_path / "export")
    # DeepSpeed's stage files (dense partitions) and hfpar's per-rank expert files (experts, their AdamW states)
    assert_resume_from_step_4(
        EXTENDED["ep2_pp2_zero1"], extended_runs["ep2_pp2_zero1"], base_model, tmp_path, "ep2_pp2_zero1"
    )


@pytest.mark.extended
@pytest.mark.parametrize("case", [c for c in EXTENDED if c.startswith(("pp2_cp2", "pp2_tp2", "pp4"))])
def test_pp_extended_compositions_match_single(extended_runs, single_run, case):
    ref, ref_eval = read_metrics(single_run)
    got, got_eval = read_metrics(extended_runs[case])
    assert len(got) == 8
    for key in ("loss", "grad_norm"):
        assert_close_series(ref, got, key, TOL, case)
    assert_close_series(ref_eval, got_eval, "eval_loss", TOL, case)
    assert_export_matches(single_run, extended_runs[case], case)


@pytest.mark.extended
@pytest.mark.parametrize("case", MULTI)
def test_pp_with_two_or_three_more_parallelisms_matches_single(extended_runs, single_run, base_weights, tmp_path, case):
    """Each stage tensor- / expert- / context-parallel at once (TP x CP x PP, EP x CP x PP, TP x EP x PP, all four):
    per step loss and grad_norm, eval loss and the export against the one-process run (MoE: moe_single, the upcycled
    model's Mixtral export reloadable, the checkpoint's export the final one)."""
    flags, got_dir = EXTENDED[case][3], extended_runs[case]
    info = read_run_info(got_dir)
    assert info["pp_schedule"] == (flags[flags.index("--pp_schedule") + 1] if "--pp_schedule" in flags else "1f1b")
    if "--upcycle_experts" in flags:  # EP x ZeRO-1 checkpoints have no full form (test_ep_pp_zero1_...)
        _assert_ep_pp_matches(
            extended_runs["moe_single"], got_dir, case, tmp_path, exports_checkpoint=not case.endswith("zero1")
        )
        return
    assert_steps_match(single_run, got_dir, case)
    assert_close_series(read_metrics(single_run)[1], read_metrics(got_dir)[1], "eval_loss", TOL, case)
    assert_export_matches(single_run, got_dir, case, initial=base_weights)
    assert rel_close(export_eval_loss(got_dir), read_metrics(got_dir)[1][-1]["eval_loss"], 1e-4)
    sizes = _sizes(case)
    assert {k: info[k] for k in sizes} == sizes, info
    if case.endswith("zero1"):  # DeepSpeed partitions per pipeline stage: no full form, refused in one line
        with pytest.raises(ExportError, match="DeepSpeed partitions per pipeline stage, which have no full form"):
            export_checkpoint(got_dir / "checkpoint-8", tmp_path / "export")
        return
    assert_checkpoint_exports_final(got_dir, tmp_path, case)
