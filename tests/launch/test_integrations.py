"""Stock transformers.Trainer, TRL SFTTrainer and DPOTrainer train hfpar TP / EP / TP x EP models through
hfpar.integrations and match the same trainer in one process; every unsafe entry point is refused in one line.

    python -m pytest -q -p no:cacheprovider tests/launch/test_integrations.py

One torchrun launch of 2 processes runs six trainer cases in turn (and the refusals first), one of 4 processes the
TP x EP case; the one-process references run beside them (tests/helpers/trainer_cases.py). fp32, 8 optimizer steps,
gradient accumulation 2, clipping active: per-step loss and grad norm within 1e-4, the saved checkpoints (reloaded
with from_pretrained) within 1e-4; two bf16 cases (TP, EP) within the bf16 tolerances below.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers.launch import ROOT, Started, env, start_python
from tests.helpers.trainer_cases import MAX_NORM, STEPS

TOL = 1e-4
# bf16 cases (autocast, fp32 master weights) against the same trainer's one-process bf16 run: the suite's bf16 loss /
# grad-norm tolerances (tests/launch/test_bf16_parity.py; measured here 4.4e-5 / 5.2e-4), final weights normwise
# (measured 1.0e-2 on the zero-initialised q/k/v biases of Qwen2, |w| ~ 1e-5 after 8 steps; 4e-4 elsewhere)
BF16_LOSS_TOL, BF16_NORM_TOL, BF16_WEIGHT_TOL = 1.5e-3, 1e-2, 2e-2
SCRIPT = str(ROOT / "tests" / "helpers" / "trainer_cases.py")
LAUNCHES = {
    2: [
        "trainer_qwen2_tp2",
        "trainer_olmoe_ep2",
        "sft_gemma2_tp2",
        "sft_qwen2_moe_ep2",
        "dpo_qwen3_tp2",
        "dpo_olmoe_ep2",
        "trainer_qwen2_tp2_bf16",
        "trainer_olmoe_ep2_bf16",
    ],
    4: ["trainer_qwen2_moe_tp2_ep2"],
}


def _start(out, cases: list[str], nproc: int, *extra: str) -> Started:
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return start_python([*launcher, SCRIPT, str(out), "--cases", ",".join(cases), *extra], env())


def _wait(p: Started) -> None:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, (out + err)[-4000:]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
def test_trainers_match_one_process_and_unsafe_wraps_are_refused(tmp_path):
    for nproc, cases in LAUNCHES.items():  # each launch with its one-process reference beside it
        procs = [
            _start(tmp_path / "dist", cases, nproc, *(["--refusals"] if nproc == 2 else [])),
            _start(tmp_path / "ref", cases, 1, "--reference_world", str(nproc)),
        ]
        for p in procs:
            _wait(p)

    refused = json.loads((tmp_path / "dist" / "refusals.json").read_text())
    assert set(refused) == {
        "unlaunched",
        *(f"{k}_{e}" for k in ("tp", "ep") for e in ("ddp", "accelerate", "trainer", "fully_shard", "fsdp1")),
    }, refused
    for what, msg in refused.items():
        assert msg is not None and "\n" not in msg, (what, msg)
        assert ("init_process_group" if what == "unlaunched" else "hfpar.integrations.prepare_trainer") in msg, msg

    for case in [c for cases in LAUNCHES.values() for c in cases]:
        got = json.loads((tmp_path / "dist" / case / "history.json").read_text())
        ref = json.loads((tmp_path / "ref" / case / "history.json").read_text())
        assert len(got) == len(ref) == STEPS, (case, got, ref)
        assert min(n for _, n in ref) > MAX_NORM, (case, ref)  # clipping active every step
        bf16 = case.endswith("_bf16")
        loss = max(_rel(a[0], b[0]) for a, b in zip(got, ref))
        norm = max(_rel(a[1], b[1]) for a, b in zip(got, ref))
        loss_tol, norm_tol = (BF16_LOSS_TOL, BF16_NORM_TOL) if bf16 else (TOL, TOL)
        assert loss < loss_tol and norm < norm_tol, (case, loss, norm, got, ref)
        mine = AutoModelForCausalLM.from_pretrained(tmp_path / "dist" / case / "model").state_dict()
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "ref" / case / "model").state_dict()
        assert mine.keys() == base.keys(), case
        for k, v in base.items():
            if bf16:
                assert ((mine[k] - v).norm() / v.norm().clamp_min(1e-12)).item() < BF16_WEIGHT_TOL, (case, k)
            else:
                assert ((mine[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() < TOL, (case, k)
