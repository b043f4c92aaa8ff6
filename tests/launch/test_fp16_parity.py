"""fp16 end to end on CPU: real `accelerate launch --mixed_precision fp16` runs of the compositions against the
single-process fp16 run, and overflowed steps skipped on every rank.

    python -m pytest -q -s -p no:cacheprovider tests/launch/test_fp16_parity.py      # -s prints the measured
    differences

Accelerate 1.15 builds no fp16 autocast and no GradScaler on CPU, and hfpar refuses such a launch. These launches
put tests/helpers/fp16_cpu first on PYTHONPATH: its sitecustomize.py (TEST-ONLY) makes Accelerate build on CPU what it
builds on a GPU (native_amp, fp16 autocast, its GradScaler / FSDP2 grad scaler), so Accelerate's own fp16 paths
(backward, clip_grad_norm_'s unscale, AcceleratedOptimizer's skipped step), hfpar's model-parallel scaler (TP, EP, PP:
hfpar/backends/loss_scale.py) and DeepSpeed's own fp16 loss scaler (ZeRO-2/3: DeepSpeed's CPU accelerator runs fp16,
no patch involved) all run for real. Settings as tests/launch/test_bf16_parity.py (8 steps, global batch 8, clipping,
accumulation 2).

Parity: single, DDP, FSDP2, ZeRO-2, TP=2 over DDP, PP=2 (1F1B), EP=2 of an upcycled 4-expert model (against the
same model in one process); with HFPAR_FP16_CASES=all also ZeRO-3, TP=2 over hfpar's FSDP2 wrap, CP=2 (ring) and
LoRA x DDP (against single LoRA), measured once (below) and left out of the default suite for its time; per
step loss and grad_norm within LOSS_TOL / NORM_TOL (about 3x the largest difference measured), no step skipped, the
loss scale recorded on every step, final eval loss within EVAL_TOL of the fp32 single-process run's. Not run here:
TP / EP / CP-with-TP over ZeRO in fp16 (refused in one line by hfpar), PP over ZeRO-1 (fp32 only).

ZeRO in fp16 needs DeepSpeed's accelerator to run fp16: on CPU that is oneDNN's fp16 (x86 CPUs with AVX512-FP16 or
AMX-FP16; not an AVX2-only AMD EPYC, with the CPU or the CUDA torch build alike), else DeepSpeed stops at initialize
("Type fp16 is not supported on your device"). There hfpar's preflight refuses the launch in one line before the model
loads (tested below), and the ZeRO cases are skipped with that line as the reason; the others run.

Overflow: the loss scale starts where steps 1 and 2 overflow and step 3 does not: 2**20 for the GradScaler
(HFPAR_TEST_FP16_INIT_SCALE), 2**18 for DeepSpeed (initial_scale_power, hysteresis 1: halve on the first overflow as
GradScaler does; its fp16 weights and grads overflow sooner: from 2**20 it skipped steps 1-4 and 6, measured).
Single, DDP (Accelerate's scaler), TP=2 (hfpar's scaler) and ZeRO-2 (DeepSpeed's): metrics.jsonl marks steps 1-2
skipped, the scale halves twice, the loss of every step and the unscaled grad_norm of steps 3-8 equal the
single-process run's with the same initial scale (steps 1-3 ran the initial weights); the sitecustomize's per-rank
trace (GradScaler runs) shows each rank found the overflow, left its parameters unchanged, and holds the same scale
after the same number of steps.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from hfpar.backends.zero import deepspeed_fp16_problem
from tests.helpers.launch import ROOT, launch, model_with_unreadable_weights, read_metrics, read_run_info, rel_diff
from tests.helpers.parity import COMMON

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # on demand: -m extended (docs/testing.md)

MOE = ["--upcycle_experts", "4", "--moe_top_k", "2", "--moe_aux_loss_coef", "0.01"]
LORA = ["--use_peft", "--lora_dropout", "0"]
# FSDP2 reduce-scatters grads in fp16 (Accelerate's fp16 policy: param and reduce dtype fp16; hfpar's wrap takes the
# same policy): at the default initial scale 2**16 its first step overflows and is skipped (measured), which the
# single run's does not, so the FSDP2 cases start at 2**12 (no step overflows) against the single run at 2**16
LOW = 2.0**12
CASES = {  # name: (accelerate config, processes, per-device batch, extra flags, reference case, initial loss scale)
    "single": ("single", 1, "4", [], None, None),
    "ddp": ("ddp", 2, "2", [], "single", None),
    "fsdp2": ("fsdp2", 2, "2", [], "single", LOW),
    "zero2": ("zero2", 2, "2", [], "single", None),
    "tp2": ("ddp", 2, "4", ["--tp_size", "2"], "single", None),
    "pp2": ("ddp", 2, "4", ["--pp_size", "2"], "single", None),
    "single_moe": ("single", 1, "4", MOE, None, None),
    "ep2": ("ddp", 2, "2", [*MOE, "--ep_size", "2"], "single_moe", None),
}
# measured (below), launched with HFPAR_FP16_CASES=all, not by default (suite time: 40-90 s a launch on 2 cores);
# their fp16 machinery is that of the cases above (Accelerate's / DeepSpeed's scaler, hfpar's FSDP2 wrap)
EXTRA = {
    "zero3": ("zero3", 2, "2", [], "single", None),
    "tp2_fsdp2": ("fsdp2", 2, "4", ["--tp_size", "2"], "single", LOW),
    "cp2": ("ddp", 2, "4", ["--cp_size", "2", "--cp_mode", "ring"], "single", None),
    "single_lora": ("single", 1, "4", LORA, None, None),
    "lora_ddp": ("ddp", 2, "2", LORA, "single_lora", None),
    "zero1": ("zero1", 2, "2", [], "single", None),
    "pp2_fsdp2": ("fsdp2", 4, "2", ["--pp_size", "2"], "single", LOW),
}
OVERFLOW = {  # name: (accelerate config, processes, per-device batch, extra flags, initial loss scale)
    "ovf_single": ("single", 1, "4", [], 2.0**20),
    "ovf_ddp": ("ddp", 2, "2", [], 2.0**20),
    "ovf_tp2": ("ddp", 2, "4", ["--tp_size", "2"], 2.0**20),
    "ovf_zero2": ("zero2_fp16_scale18", 2, "2", [], 2.0**18),  # set by the DeepSpeed config below
}
TRACED = ("ovf_single", "ovf_ddp", "ovf_tp2")  # GradScaler runs (DeepSpeed's scaler is its own)
# HFPAR_FP16_CASES: "all" adds EXTRA to the default cases; names (e.g. zero1,pp2_fsdp2) run only those and their
# references, without the overflow runs
_NAMES = [n.strip() for n in os.environ.get("HFPAR_FP16_CASES", "").split(",") if n.strip()]
if _NAMES == ["all"]:
    CASES.update(EXTRA)
elif _NAMES:
    _EVERY = {**CASES, **EXTRA}
    assert all(n in _EVERY for n in _NAMES), f"HFPAR_FP16_CASES {_NAMES}: known cases are all, {', '.join(_EVERY)}"
    _KEEP = set(_NAMES) | {_EVERY[n][4] for n in _NAMES if _EVERY[n][4]}
    CASES = {n: spec for n, spec in _EVERY.items() if n in _KEEP}
    OVERFLOW = {}
ZERO2_SCALE18 = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "initial_scale_power": 18, "hysteresis": 1},
}
ZERO2_YAML = (
    "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {json}\n"
    "  zero3_init_flag: false\nnum_machines: 1\nmachine_rank: 0\nrdzv_backend: static\nsame_network: true\n"
    "use_cpu: false\n"
)
# Measured (2026-11-25, this file with -s; largest relative difference over the 8 steps, loss / grad_norm):
# ddp 8.1e-6 / 3.1e-5, fsdp2 2.4e-4 / 3.9e-4 (fp16 parameters and grad reduction: Accelerate's FSDP2 policy),
# zero2 3.6e-5 / 2.4e-4, zero3 2.8e-5 / 2.4e-4 (DeepSpeed: fp16 weights), tp2 7.8e-6 / 3.1e-5, tp2_fsdp2 3.4e-4 /
# 4.6e-4, cp2 8.1e-6 / 1.6e-4, pp2 5.2e-6 / 7.8e-5, ep2 1.0e-5 / 6.0e-5, lora_ddp 4.4e-6 / 9.0e-5; final eval loss
# vs the fp32 single run <= 9.8e-5 (fsdp2, tp2_fsdp2), <= 2.2e-5 for the others; single fp16 vs fp32 loss 1.1e-5.
# EXTRA, measured with HFPAR_FP16_CASES=zero1 / pp2_fsdp2: zero1 (DeepSpeed's fp16) 2.3e-5 / 2.4e-4, pp2_fsdp2 (pp 2 x
# dp 2, from scale 2**12) 1.1e-5 / 1.3e-4; eval vs fp32 single 1.3e-5 / 5.4e-6. EP x FSDP2 in fp16 is refused in one
# line (the GradScaler's foreach unscale refuses the experts' plain grads beside FSDP2's DTensors: found here).
# Overflow runs vs ovf_single (grad_norm: steps 3-8): ovf_ddp 1.5e-5 / 7.5e-5, ovf_tp2 5.5e-5 / 6.7e-5, ovf_zero2
# 7.7e-5 / 5.9e-4 (DeepSpeed's fp16 weights against autocast over fp32 ones).
LOSS_TOL = {"fsdp2": 1e-3, "tp2_fsdp2": 1e-3, "ovf_zero2": 2.5e-4}  # per case; others DEFAULT_LOSS_TOL
NORM_TOL = {"fsdp2": 1.5e-3, "tp2_fsdp2": 1.5e-3, "ovf_zero2": 2e-3}
DEFAULT_LOSS_TOL, DEFAULT_NORM_TOL, EVAL_TOL, FP32_TOL = 1.5e-4, 7e-4, 3e-4, 3.5e-5


def fp16_env(init_scale: float | None = None, trace_dir=None) -> dict:
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'helpers' / 'fp16_cpu'}:{ROOT}", "HFPAR_TEST_FP16_CPU": "1"}
    if init_scale is not None:
        env["HFPAR_TEST_FP16_INIT_SCALE"] = repr(init_scale)
    if trace_dir is not None:
        env["HFPAR_TEST_FP16_TRACE"] = str(trace_dir)
    return env


@pytest.fixture(scope="module")
def zero_fp16_problem() -> str | None:
    """The line hfpar's preflight refuses a ZeRO fp16 launch with here (DeepSpeed's accelerator has no fp16), else
    None. Asked in this process (importing deepspeed costs ~2.5 s, so not at collection)."""
    return deepspeed_fp16_problem()


def skip_refused(config: str, zero_fp16_problem: str | None) -> None:
    """A ZeRO case where DeepSpeed cannot run fp16: skipped (not launched) with the preflight's reason."""
    if config.startswith("zero") and zero_fp16_problem:
        pytest.skip(f"not launched, hfpar refuses it here: {zero_fp16_problem}")


@pytest.fixture(scope="module")
def fp16_runs(base_model, zero_fp16_problem, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp16")
    (root / "zero2_fp16_scale18.json").write_text(json.dumps(ZERO2_SCALE18))
    (root / "zero2_fp16_scale18.yaml").write_text(ZERO2_YAML.format(json=root / "zero2_fp16_scale18.json"))
    jobs = {name: (config, nproc, bs, extra, scale) for name, (config, nproc, bs, extra, _, scale) in CASES.items()}
    jobs.update(
        {
            name: (config, nproc, bs, extra, None if config.startswith("zero") else scale)
            for name, (config, nproc, bs, extra, scale) in OVERFLOW.items()
        }
    )
    if zero_fp16_problem:  # DeepSpeed has no fp16 here: its cases are skipped (skip_refused), not launched
        jobs = {name: job for name, job in jobs.items() if not job[0].startswith("zero")}
    outs = {name: root / name for name in jobs}

    def run(name):
        config, nproc, bs, extra, scale = jobs[name]
        config = str(root / config) if config == "zero2_fp16_scale18" else config  # absolute: not accelerate_configs/
        trace = outs[name] / "fp16_trace" if name in TRACED else None
        if trace is not None:
            trace.mkdir(parents=True)
        launch(
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
            extra_launch=["--mixed_precision", "fp16"],
            extra_env=fp16_env(scale, trace),
        )

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(run, name) for name in jobs]:
            f.result()
    return {name: outs[name] for name in jobs}


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[4]])
def test_fp16_matches_single_fp16(zero_fp16_problem, fp16_runs, single_run, case):
    skip_refused(CASES[case][0], zero_fp16_problem)
    ref, ref_eval = read_metrics(fp16_runs[CASES[case][4]])
    got, got_eval = read_metrics(fp16_runs[case])
    assert len(got) == len(ref) == 8
    assert not any(r.get("skipped") for r in got + ref), "a parity run overflowed"
    scale = CASES[case][5] or 2.0**16
    assert [r.get("loss_scale") for r in got] == [scale] * 8  # loss scaling was on (fp16, not fp32 in disguise)
    assert read_run_info(fp16_runs[case])["mixed_precision"] == "fp16"
    loss = max(rel_diff(g["loss"], r["loss"]) for g, r in zip(got, ref))
    norm = max(rel_diff(g["grad_norm"], r["grad_norm"]) for g, r in zip(got, ref))
    assert [g["num_target_tokens"] for g in got] == [r["num_target_tokens"] for r in ref]
    fp32_eval = read_metrics(single_run)[1]
    vs_ref = rel_diff(got_eval[-1]["eval_loss"], ref_eval[-1]["eval_loss"])
    vs_fp32 = (
        rel_diff(got_eval[-1]["eval_loss"], fp32_eval[-1]["eval_loss"]) if CASES[case][4] == "single" else math.nan
    )
    print(f"FP16 {case}: loss {loss:.2e} grad_norm {norm:.2e} eval {vs_ref:.2e} eval vs fp32 single {vs_fp32:.2e}")
    loss_tol, norm_tol = LOSS_TOL.get(case, DEFAULT_LOSS_TOL), NORM_TOL.get(case, DEFAULT_NORM_TOL)
    assert loss <= loss_tol and norm <= norm_tol, (loss, norm)
    assert vs_ref <= loss_tol
    if CASES[case][4] == "single":
        assert vs_fp32 <= EVAL_TOL, vs_fp32


def test_single_fp16_computes_in_fp16(fp16_runs, single_run):
    """The fp16 single run is not the fp32 one: autocast rounds its matmuls (the losses differ from the fp32 run's,
    by little)."""
    got, fp32 = read_metrics(fp16_runs["single"])[0], read_metrics(single_run)[0]
    diff = max(rel_diff(g["loss"], r["loss"]) for g, r in zip(got, fp32))
    print(f"FP16 single vs fp32 single: loss {diff:.2e}")
    assert 1e-7 < diff <= FP32_TOL, diff


def _trace(out) -> list[list[dict]]:
    files = sorted((out / "fp16_trace").glob("rank*.jsonl"))
    return [[json.loads(x) for x in f.read_text().splitlines()] for f in files]


@pytest.mark.parametrize("case", [c for c in OVERFLOW if c != "ovf_single"])
def test_overflowed_steps_skipped_on_every_rank(zero_fp16_problem, fp16_runs, case):
    skip_refused(OVERFLOW[case][0], zero_fp16_problem)
    ref = read_metrics(fp16_runs["ovf_single"])[0]
    got = read_metrics(fp16_runs[case])[0]
    start = OVERFLOW[case][4]
    scales = [start, start / 2] + [start / 4] * 6
    for run, s in ((ref, OVERFLOW["ovf_single"][4]), (got, start)):
        assert [r["step"] for r in run] == list(range(1, 9))
        assert [bool(r.get("skipped")) for r in run] == [True, True] + [False] * 6
        assert [r["loss_scale"] for r in run] == [s, s / 2] + [s / 4] * 6  # halved after each overflow, then held
        assert not any(math.isfinite(r["grad_norm"]) for r in run[:2])
    # every step's loss, and the clean steps' grad norm (unscaled: a scaled one would be 2**18 times larger),
    # equal the single run's with the same start: the skipped steps left every rank's weights as they were
    loss = max(rel_diff(g["loss"], r["loss"]) for g, r in zip(got, ref))
    norm = max(rel_diff(g["grad_norm"], r["grad_norm"]) for g, r in zip(got[2:], ref[2:]))
    print(f"FP16 overflow {case}: loss {loss:.2e} grad_norm (steps 3-8) {norm:.2e}")
    assert loss <= LOSS_TOL.get(case, DEFAULT_LOSS_TOL) and norm <= NORM_TOL.get(case, DEFAULT_NORM_TOL), (loss, norm)
    assert all(r["grad_norm"] < 100 for r in got[2:])
    if case in TRACED:
        ranks = _trace(fp16_runs[case])
        assert len(ranks) == 2 and ranks[0] == ranks[1], ranks  # the same decisions and scales on both ranks
        for steps in ranks:
            assert [s["found_inf"] for s in steps] == [True, True] + [False] * 6
            assert [s["params_changed"] for s in steps] == [False, False] + [True] * 6
            assert [s["scale"] for s in steps] == scales[1:] + [scales[-1]]


@pytest.mark.skipif("ovf_single" not in OVERFLOW, reason="HFPAR_FP16_CASES names cases: no overflow runs")
def test_single_overflow_trace(fp16_runs):
    """The reference itself: Accelerate's GradScaler found the overflow and left the weights as they were."""
    (steps,) = _trace(fp16_runs["ovf_single"])
    assert [(s["found_inf"], s["params_changed"]) for s in steps] == [(True, False)] * 2 + [(False, True)] * 6


def test_fp16_without_the_test_patch_is_refused_in_one_line(tmp_path):
    """The same launch without tests/helpers/fp16_cpu: Accelerate builds no GradScaler on CPU, and hfpar refuses."""
    proc = launch(
        "ddp", 2, "sft", ["--output_dir", str(tmp_path / "o")], check=False, extra_launch=["--mixed_precision", "fp16"]
    )
    assert proc.returncode != 0
    assert (
        "hfpar: error: --mixed_precision fp16 on CPU: Accelerate runs no fp16 autocast and no loss scaling"
        in proc.stderr
    ), proc.stderr[-2000:]
    assert "hfpar.config.ConfigError" not in proc.stderr, proc.stderr[-2000:]


def test_zero_fp16_refused_in_one_line_where_deepspeed_has_no_fp16(zero_fp16_problem, base_model, tmp_path):
    """Where DeepSpeed's accelerator has no fp16, a ZeRO fp16 launch stops in hfpar's preflight with one line, before
    any weight is read (the weights file is not safetensors), instead of in deepspeed.initialize after the load."""
    if not zero_fp16_problem:
        pytest.skip("DeepSpeed's accelerator runs fp16 on this machine: nothing to refuse (the ZeRO fp16 cases run)")
    model = model_with_unreadable_weights(base_model, tmp_path / "model")
    proc = launch(
        "zero2",
        2,
        "sft",
        ["--model_name_or_path", model, "--output_dir", str(tmp_path / "o")],
        check=False,
        extra_launch=["--mixed_precision", "fp16"],
    )
    assert proc.returncode != 0
    assert f"hfpar: error: {zero_fp16_problem}\n" in proc.stderr, proc.stderr[-2000:]
    assert "not supported on your device" not in proc.stderr, proc.stderr[-2000:]
