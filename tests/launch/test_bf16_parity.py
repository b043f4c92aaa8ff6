"""The parity contract in the shipped precision: bf16 autocast runs of the compositions against the single-process
bf16 run, per step, under tolerances measured here (fp32 parity is exact to 1e-4: the other parity suites).

    python -m pytest -q -s -p no:cacheprovider tests/launch/test_bf16_parity.py      # -s prints the measured
    differences

8 steps, global batch 8 (the fp32 suites' settings), `--mixed_precision bf16` on the launcher. CASES (the suite):
DDP, FSDP2, ZeRO-2/3, TP=2 (over DDP and hfpar's FSDP2 wrap), CP=2 ring, PP=2 (1F1B) against single; EP=2 of an
upcycled 4-expert model (over DDP, FSDP2, ZeRO-1 where DeepSpeed runs its BF16_Optimizer, and ZeRO-2) against the
same model in one process; LoRA over FSDP2 against single LoRA. EXTRA (on demand, measured once each; several were
in CASES until 2026-11-26 and moved for the CI time budget): ZeRO-1, TP=2 over ZeRO-1 / ZeRO-2, CP=2 Ulysses, TP=2 x
dp=2 (DDP, FSDP2) and PP=2 x FSDP2 dp=2 on 4 processes against single; EP=2 x TP=2 on 4 processes (DDP, FSDP2,
ZeRO-1, ZeRO-2), EP=2 x PP=2 (1F1B over DDP, interleaved over FSDP2), EP=2 x CP=2 (ring over DDP, Ulysses over
FSDP2) against the MoE one; LoRA over DDP, ZeRO-1/2/3 and PP=2 against single LoRA; TP=2 x CP=2 and PP=2 x TP=2 (SP)
on 4 processes against single.
bf16 rounds the matmuls differently when the work is split differently (TP halves the
reduction dimension of row-parallel layers, CP and PP change the accumulation order, DDP / FSDP2 / ZeRO reduce
bf16-autocast results computed on half the rows), so the runs drift apart step by step; LOSS_TOL and NORM_TOL bound
that drift (relative, any step) at about 3x the largest difference measured on this machine (below).
The final eval loss of each bf16 run is also within EVAL_TOL of the fp32 single-process run's (tests/helpers/parity.py),
and its exported weights within EXPORT_TOL of the reference's (normwise; printed per group: dense, experts, router).
EP x ZeRO-1's exported experts sit 1.6e-2 from the one-process run's where EP over DDP sits at 1.3e-3: DeepSpeed's
bf16 (the engine casts the whole model to bf16) against autocast over fp32 weights, not EP beside DeepSpeed's
optimizer; measured on demand (HFPAR_BF16_CASES=ep2_zero1,single_moe_zero1,single_moe_accum4, its test's docstring).

HFPAR_BF16_CASES=name,name (e.g. tp2_zero1,lora_fsdp2, or all: CASES and EXTRA) launches and tests only those cases and
their references (added automatically); unset, the CASES run (EXTRA: more compositions, measured once, on demand).
"""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from tests.helpers.launch import launch_all, read_metrics, read_run_info, rel_diff
from tests.helpers.parity import COMMON

pytestmark = pytest.mark.slow

MOE = ["--upcycle_experts", "4", "--moe_top_k", "2", "--moe_aux_loss_coef", "0.01"]
LORA = ["--use_peft", "--lora_dropout", "0"]
CASES = {  # name: (accelerate config, processes, per-device batch, extra flags, reference case)
    "single": ("single", 1, "4", [], None),
    "ddp": ("ddp", 2, "2", [], "single"),
    "fsdp2": ("fsdp2", 2, "2", [], "single"),
    "tp2": ("ddp", 2, "4", ["--tp_size", "2"], "single"),
    "cp2": ("ddp", 2, "4", ["--cp_size", "2", "--cp_mode", "ring"], "single"),
    "pp2": ("ddp", 2, "4", ["--pp_size", "2"], "single"),
    "single_moe": ("single", 1, "4", MOE, None),
    "ep2": ("ddp", 2, "2", [*MOE, "--ep_size", "2"], "single_moe"),
    # bf16 + ZeRO-1 with fp32 grad accumulation: DeepSpeed's BF16_Optimizer (zero1.yaml runs its ZeRO optimizer)
    "ep2_zero1": ("zero1_fp32_accum", 2, "2", [*MOE, "--ep_size", "2"], "single_moe"),
    # LoRA (dropout 0: its masks depend on how a batch is split over ranks) against its own single bf16 run
    "single_lora": ("single", 1, "4", LORA, None),
    "lora_fsdp2": ("fsdp2", 2, "2", LORA, "single_lora"),
}
# More compositions, measured once (below) and run on demand (HFPAR_BF16_CASES=all or by name), not by default:
# each launch costs 40-90 s on 2 cores, and their backends are those of CASES above (their fp32 parity is in
# the other suites).
EXTRA = {
    # hfpar's own FSDP2 wrap (dp = 1 here: the config's bf16 policy still casts the gathered weights); in CASES until
    # 2026-11-28 (moved for the suite's budget)
    "tp2_fsdp2": ("fsdp2", 2, "4", ["--tp_size", "2"], "single"),
    "ep2_fsdp2": ("fsdp2", 2, "2", [*MOE, "--ep_size", "2"], "single_moe"),
    # moved here on 2026-11-28 (GRPO's tests came in): two DeepSpeed launches (ZeRO-2 with EP, ZeRO-3)
    "zero2": ("zero2", 2, "2", [], "single"),
    "ep2_zero2": ("zero2", 2, "2", [*MOE, "--ep_size", "2"], "single_moe"),
    "zero3": ("zero3", 2, "2", [], "single"),
    # in CASES until 2026-11-26, moved here for the CI time budget (their figures below; measured again then)
    # autocast around each micro-batch's forward only: FSDP2's re-gathered weights must not share one autocast cache
    "pp2_fsdp2": ("fsdp2", 4, "2", ["--pp_size", "2"], "single"),
    "cp2_ulysses": ("ddp", 2, "4", ["--cp_size", "2", "--cp_mode", "ulysses"], "single"),
    "zero1": ("zero1", 2, "2", [], "single"),
    # TP over DeepSpeed (hfpar's mpu; dp = 1 on 2 processes)
    "tp2_zero2": ("zero2", 2, "4", ["--tp_size", "2"], "single"),
    "lora_ddp": ("ddp", 2, "2", LORA, "single_lora"),
    "tp2_zero1": ("zero1", 2, "4", ["--tp_size", "2"], "single"),
    "lora_zero2": ("zero2", 2, "2", LORA, "single_lora"),
    "tp2_dp2_fsdp2": ("fsdp2", 4, "2", ["--tp_size", "2"], "single"),
    "lora_zero1": ("zero1", 2, "2", LORA, "single_lora"),
    "lora_zero3": ("zero3", 2, "2", LORA, "single_lora"),
    # 4 processes, dp = 2 beside tp = 2 over DDP
    "tp2_dp2_ddp": ("ddp", 4, "2", ["--tp_size", "2"], "single"),
    **{
        f"ep2_tp2{'' if c == 'ddp' else '_' + c}": (c, 4, "2", [*MOE, "--ep_size", "2", "--tp_size", "2"], "single_moe")
        for c in ("ddp", "fsdp2", "zero1", "zero2")
    },
    # TP=2 x CP=2 ring and PP=2 x TP=2 (+SP) on 4 processes (dp = 1), LoRA in both stages of PP=2
    "cp2_tp2": ("ddp", 4, "4", ["--cp_size", "2", "--tp_size", "2", "--cp_mode", "ring"], "single"),
    "pp2_tp2_sp": ("ddp", 4, "4", ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel"], "single"),
    "lora_pp2": ("ddp", 2, "4", [*LORA, "--pp_size", "2"], "single_lora"),
    # EP=2 x PP=2 (dp 2) of the upcycled model: 1F1B over DDP, interleaved over FSDP2 (routing statistics per
    # pipeline micro-batch, the reference's per micro-step: a difference far below bf16's, measured in fp32 below)
    "ep2_pp2": ("ddp", 4, "2", [*MOE, "--ep_size", "2", "--pp_size", "2"], "single_moe"),
    "ep2_pp2_interleaved_fsdp2": (
        "fsdp2",
        4,
        "2",
        [*MOE, "--ep_size", "2", "--pp_size", "2", "--pp_schedule", "interleaved_1f1b", "--pp_microbatches", "2"],
        "single_moe",
    ),
    # EP=2 drawn from the cp ranks (cp = 2, dp = 1), ring over DDP and Ulysses over hfpar's FSDP2 wrap
    "ep2_cp2": ("ddp", 2, "4", [*MOE, "--ep_size", "2", "--cp_size", "2", "--cp_mode", "ring"], "single_moe"),
    "ep2_cp2_ulysses_fsdp2": (
        "fsdp2",
        2,
        "4",
        [*MOE, "--ep_size", "2", "--cp_size", "2", "--cp_mode", "ulysses"],
        "single_moe",
    ),
    # what explains ep2_zero1's exported weights (test_ep_zero1_bf16_export_gap_is_deepspeeds_bf16): the MoE model in
    # ONE process under DeepSpeed's bf16 (BF16_Optimizer, the experts in it: no EP), and one process with the same
    # global batch in 4 accumulation steps instead of 2 (how far bf16 alone moves a run that rounds differently)
    "single_moe_zero1": ("zero1_fp32_accum", 1, "4", MOE, "single_moe"),
    "single_moe_accum4": ("single", 1, "2", [*MOE, "--gradient_accumulation_steps", "4"], "single_moe"),
}
# accelerate configs written by the fixture: {name: (accelerate yaml, deepspeed json)}, "{json}" the json's path
GENERATED = {
    "zero1_fp32_accum": (
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {json}\n  zero3_init_flag: false\n"
        "num_machines: 1\nmachine_rank: 0\nrdzv_backend: static\nsame_network: true\nuse_cpu: false\n",
        {
            "zero_optimization": {"stage": 1},
            "bf16": {"enabled": "auto"},
            "data_types": {"grad_accum_dtype": "fp32"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        },
    )
}
# Measured (2026-11-25, this file with -s; largest relative difference over the 8 steps, loss / grad_norm):
# ddp 4.0e-5 / 1.7e-4, fsdp2 2.1e-3 / 3.1e-3 (FSDP2 all-gathers bf16 parameters: its mixed-precision policy, not
# autocast of fp32 weights; norms and embeddings compute in bf16 too), zero2 3.7e-4 / 2.6e-3, zero3 3.8e-4 / 2.6e-3,
# tp2 6.1e-5 / 5.0e-4, tp2_fsdp2 2.2e-3 / 3.4e-3 (hfpar's wrap now takes the config's policy: as fsdp2),
# cp2 9.4e-5 / 3.7e-4, cp2_ulysses 1.3e-4 / 2.4e-4, pp2 5.3e-5 / 1.8e-3, ep2 1.2e-4 / 4.1e-4,
# ep2_fsdp2 2.1e-3 / 3.5e-3, ep2_zero1 (BF16_Optimizer) 3.9e-4 / 2.7e-3; final eval loss vs the fp32 single run <=
# 2.1e-4 for all. zero1 4.2e-4 / 2.6e-3, tp2_zero2 3.8e-4 / 3.0e-3, lora_ddp (vs single LoRA bf16) 2.7e-5 / 4.8e-4.
# pp2_fsdp2 (pp 2 x dp 2, the config's bf16 policy, as fsdp2): 2.6e-4 / 1.7e-3 (1.1e-2 / 0.42 measured by hand before
# the pipeline autocast its forwards only).
# tp2_zero1 (TP over DeepSpeed ZeRO-1, dp = 1) 3.8e-4 / 3.0e-3, ep2_zero2 4.1e-4 / 2.8e-3; LoRA vs single LoRA bf16:
# lora_fsdp2 2.4e-3 / 3.4e-3 (FSDP2's bf16 parameter policy: as fsdp2), lora_zero1 1.2e-4 / 3.7e-3, lora_zero2
# 9.2e-5 / 3.4e-3, lora_zero3 9.7e-5 / 3.4e-3. On 4 processes (dp = 2): tp2_dp2_ddp 6.4e-5 / 4.4e-4, tp2_dp2_fsdp2
# 2.1e-3 / 3.4e-3 (as fsdp2); EP=2 x TP=2 (dp = 2) vs single MoE bf16: ep2_tp2 (DDP) 1.5e-4 / 4.4e-4, ep2_tp2_fsdp2
# 2.1e-3 / 3.4e-3 (as fsdp2), ep2_tp2_zero1 4.0e-4 / 2.6e-3, ep2_tp2_zero2 3.6e-4 / 2.7e-3; cp2_tp2 1.1e-4 / 3.2e-4,
# pp2_tp2_sp 1.5e-4 / 1.9e-3, lora_pp2 (vs single LoRA bf16) 5.5e-5 / 1.7e-3; final eval loss vs the fp32 single run
# <= 2.2e-4 (tp2_dp2_ddp 2.16e-4). EP=2 x PP=2 (dp 2) vs single MoE bf16: ep2_pp2 (1F1B, DDP) 1.9e-4 / 1.6e-3,
# ep2_pp2_interleaved_fsdp2 3.1e-4 / 1.9e-3 (HFPAR_BF16_CASES=ep2_pp2,ep2_pp2_interleaved_fsdp2, 2026-11-26). Not run in
# bf16 (their fp32 parity is in the other suites; the backends are those <= 2.2e-4 (tp2_dp2_ddp 2.16e-4). EP=2 x CP=2
# (dp 1) vs single MoE bf16: ep2_cp2 (ring, DDP) 1.2e-4 / 4.8e-4, ep2_cp2_ulysses_fsdp2 1.8e-3 / 3.6e-3 (as fsdp2). Not
# run in bf16 (their fp32 parity is in the other suites; the backends are those of cases above): TP x CP over FSDP2 /
# ZeRO-1/2, PP x TP over FSDP2. PP x ZeRO-1 in bf16 is refused in one line.


def _selected() -> dict:
    """CASES restricted to HFPAR_BF16_CASES (and the references those need), in CASES order; all when unset."""
    names = [n.strip() for n in os.environ.get("HFPAR_BF16_CASES", "").split(",") if n.strip()]
    if not names:
        return dict(CASES)
    every = {**CASES, **EXTRA}
    if names == ["all"]:
        return every
    unknown = [n for n in names if n not in every]
    assert not unknown, f"HFPAR_BF16_CASES: unknown cases {unknown}; known: all, {', '.join(every)}"
    keep = set(names) | {every[n][4] for n in names if every[n][4]}
    return {n: spec for n, spec in every.items() if n in keep}


SELECTED = _selected()
# per case, others DEFAULT_LOSS_TOL: FSDP2's bf16 parameter policy (fsdp2 above), also with TP, EP, TP x EP and LoRA
LOSS_TOL = {
    name: 6e-3
    for name in (
        "fsdp2",
        "tp2_fsdp2",
        "ep2_fsdp2",
        "lora_fsdp2",
        "tp2_dp2_fsdp2",
        "ep2_tp2_fsdp2",
        "ep2_cp2_ulysses_fsdp2",
    )
}
DEFAULT_LOSS_TOL, NORM_TOL, EVAL_TOL = 1.5e-3, 1e-2, 1e-3  # loss: LOSS_TOL per case, else DEFAULT_LOSS_TOL
DEEPSPEED = {"zero1", "zero2", "zero3", "zero1_fp32_accum"}  # configs whose engine casts the model to bf16
# Exported weights vs the reference's, normwise over all tensors: ||got - ref|| / ||ref|| (export_diffs), by the
# reference's model and whether DeepSpeed ran it, about 3x the largest measured (2026-11-28, -s, the BF16 EXPORT
# lines; "all" / experts): ddp 2.7e-4, tp2 5.7e-4, cp2 4.8e-4, pp2 4.6e-4, fsdp2 9.9e-4; zero1 2.2e-3, zero2 2.2e-3;
# ep2 7.8e-4 / 1.3e-3, ep2_fsdp2 4.7e-3 / 7.9e-3, ep2_zero1 9.6e-3 / 1.6e-2, ep2_zero2 9.4e-3 / 1.6e-2; LoRA adapters
# lora_fsdp2 2.9e-3, lora_zero2 3.8e-3. DeepSpeed's bf16 casts the model itself to bf16 (EP's and the MoE's part:
# test_ep_zero1_bf16_export_gap_is_deepspeeds_bf16): its runs, and the MoE model's (routing), drift further.
EXPORT_TOL = {  # (reference, DeepSpeed): tolerance
    ("single", False): 3e-3,
    ("single", True): 1e-2,
    ("single_lora", False): 1e-2,
    ("single_lora", True): 1.2e-2,
    ("single_moe", False): 1.5e-2,
    ("single_moe", True): 3e-2,
}


@pytest.fixture(scope="module")
def bf16_runs(base_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bf16")
    outs = {name: root / name for name in SELECTED}

    for name, (yaml_text, ds_json) in GENERATED.items():
        (root / f"{name}.json").write_text(json.dumps(ds_json))
        (root / f"{name}.yaml").write_text(yaml_text.format(json=root / f"{name}.json"))

    jobs = {}
    for name, (config, nproc, bs, extra, _) in SELECTED.items():
        config = str(root / config) if config in GENERATED else config  # absolute: replaces accelerate_configs/
        jobs[name] = (
            config,
            nproc,
            "sft",
            [
                *COMMON,
                *extra,
                "--model_name_or_path",
                base_model,
                "--output_dir",
                str(outs[name]),
                "--per_device_train_batch_size",
                bs,
            ],
        )
    launch_all(jobs, extra_launch=["--mixed_precision", "bf16"])  # one launch per (config, processes)
    return outs


@pytest.mark.parametrize("case", [c for c, spec in SELECTED.items() if spec[4]])
def test_bf16_matches_single_bf16(bf16_runs, single_run, case):
    ref, ref_eval = read_metrics(bf16_runs[SELECTED[case][4]])
    got, got_eval = read_metrics(bf16_runs[case])
    assert len(got) == len(ref) == 8
    loss = max(rel_diff(g["loss"], r["loss"]) for g, r in zip(got, ref))
    norm = max(rel_diff(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref))
    assert [g["num_target_tokens"] for g in got] == [r["num_target_tokens"] for r in ref]
    fp32_eval = read_metrics(single_run)[1][-1]["eval_loss"]
    vs_fp32 = rel_diff(got_eval[-1]["eval_loss"], fp32_eval) if SELECTED[case][4] == "single" else float("nan")
    print(
        f"BF16 {case}: loss {loss:.2e} grad_norm {norm:.2e} eval "
        f"{rel_diff(got_eval[-1]['eval_loss'], ref_eval[-1]['eval_loss']):.2e}"
        f" eval vs fp32 single {vs_fp32:.2e}"
    )
    loss_tol = LOSS_TOL.get(case, DEFAULT_LOSS_TOL)
    assert loss <= loss_tol and norm <= NORM_TOL, (loss, norm)
    assert rel_diff(got_eval[-1]["eval_loss"], ref_eval[-1]["eval_loss"]) <= loss_tol
    if SELECTED[case][4] == "single":
        assert vs_fp32 <= EVAL_TOL, vs_fp32


@pytest.mark.skipif("ep2_zero1" not in SELECTED, reason="HFPAR_BF16_CASES leaves ep2_zero1 out")
def test_ep_zero1_bf16_ran_deepspeeds_bf16_optimizer(bf16_runs):
    """The ep2_zero1 case's parity above is that of BF16_Optimizer, whose norm hfpar joins the experts to."""
    assert "BF16_Optimizer" in read_run_info(bf16_runs["ep2_zero1"])["optimizer_wrappers"]


def export_diffs(ref_dir, got_dir) -> dict[str, float]:
    """||got - ref|| / ||ref|| of the exported weights (the adapters for LoRA), over all tensors ("all") and per
    group: "experts", "router" (the MoE gates), "dense" (the rest)."""
    name = "model.safetensors" if (ref_dir / "model.safetensors").is_file() else "adapter_model.safetensors"
    ref, got = load_file(str(ref_dir / name)), load_file(str(got_dir / name))
    assert ref.keys() == got.keys()
    sums: dict[str, list[float]] = {}
    for k, r in ref.items():
        r, g = r.float(), got[k].float()
        group = "experts" if ".experts." in k else "router" if k.endswith("block_sparse_moe.gate.weight") else "dense"
        for key in (group, "all"):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += float((g - r).square().sum())
            acc[1] += float(r.square().sum())
    return {key: (d / max(n, 1e-24)) ** 0.5 for key, (d, n) in sums.items()}


def _export_line(diffs: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2e}" for k, v in diffs.items())


@pytest.mark.parametrize("case", [c for c, spec in SELECTED.items() if spec[4]])
def test_bf16_export_tracks_reference(bf16_runs, case):
    """The exported weights within EXPORT_TOL of the reference run's (pytest -s prints them per group)."""
    config, _, _, _, ref = SELECTED[case]
    diffs = export_diffs(bf16_runs[ref], bf16_runs[case])
    print(f"BF16 EXPORT {case} vs {ref}: {_export_line(diffs)}")
    assert diffs["all"] <= EXPORT_TOL[(ref, config in DEEPSPEED)], diffs


@pytest.mark.extended  # deselected by the README's command rather than skipped there
@pytest.mark.skipif(
    not {"ep2_zero1", "single_moe_zero1", "single_moe_accum4"} <= SELECTED.keys(),
    reason="on demand: HFPAR_BF16_CASES=ep2_zero1,single_moe_zero1,single_moe_accum4",
)
def test_ep_zero1_bf16_export_gap_is_deepspeeds_bf16(bf16_runs):
    """EP x ZeRO-1's exported weights are further from the one-process bf16 run's than the autocast compositions'
    (experts most) because DeepSpeed's bf16 is another precision: its engine casts the whole model to bf16
    (parameters, norms, the residual stream) where the reference autocasts over fp32 weights. One process under
    DeepSpeed, without EP, is as far; EP x ZeRO-1 against that run is within the spread bf16 alone makes in one
    process (the same global batch in 4 accumulation steps instead of 2)."""
    runs = bf16_runs
    gap = export_diffs(runs["single_moe"], runs["ep2_zero1"])
    policy = export_diffs(runs["single_moe"], runs["single_moe_zero1"])
    ep = export_diffs(runs["single_moe_zero1"], runs["ep2_zero1"])
    spread = export_diffs(runs["single_moe"], runs["single_moe_accum4"])
    for what, d in (("ep2_zero1 vs single_moe", gap), ("DeepSpeed, one process", policy)):
        print(f"BF16 EXPORT {what}: {_export_line(d)}")
    print(f"BF16 EXPORT ep2_zero1 vs single_moe_zero1: {_export_line(ep)}; accum 4 vs 2: {_export_line(spread)}")
    for group in ("all", "experts"):
        assert 0.5 <= policy[group] / gap[group] <= 2, (group, policy, gap)  # the gap is there without EP
        assert ep[group] <= 2 * spread[group], (group, ep, spread)  # EP adds no more than bf16 noise
