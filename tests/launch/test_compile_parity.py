"""Regional compilation (--torch_compile) under every parallelism: the compiled run against the eager one, fp32.

    python -m pytest -q -s -m extended tests/launch/test_compile_parity.py

Dense cases (sft, the parity flags, 8 steps) against the session's single-process eager run (tests/conftest.py
single_run): DDP, FSDP2, ZeRO-3, TP=2, CP=2 (ring) and PP=2 (1F1B) on 2 gloo processes; EP=2 (upcycled to 4 experts)
against its own eager twin, launched with it. Per step (loss, grad norm) and exported weights within the parity
contract's 1e-4 (TOL); measured with aot_eager (the backend the suite can afford on CPU): 1e-7 or less, the
size of the distributed runs' own difference from one process. In the extended tier: on this 2-core machine each
case spends 1-5 minutes of CPU in dynamo under the suite's load (graph breaks at every collective make several
graphs per block). One process with inductor (the default backend, C++ kernels from g++) against the same eager run:
test_inductor_matches_eager_single.
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import read_run_info
from tests.helpers.parity import COMMON, assert_export_matches, assert_steps_match, launch_cases

pytestmark = [pytest.mark.slow, pytest.mark.extended]

COMPILE = ["--torch_compile", "--torch_compile_backend", "aot_eager"]
DENSE = {  # name: (accelerate config, processes, per-device batch, extra flags)
    "ddp": ("ddp", 2, "2", COMPILE),
    "fsdp2": ("fsdp2", 2, "2", COMPILE),
    "zero3": ("zero3", 2, "2", COMPILE),
    "tp2": ("ddp", 2, "4", ["--tp_size", "2", *COMPILE]),
    "cp2": ("ddp", 2, "4", ["--cp_size", "2", "--cp_mode", "ring", *COMPILE]),
    "pp2": ("ddp", 2, "4", ["--pp_size", "2", *COMPILE]),
}
MOE = ["--upcycle_experts", "4", "--moe_top_k", "2", "--moe_aux_loss_coef", "0.01"]
EP = {"ep2_eager": ("ddp", 2, "2", ["--ep_size", "2"]), "ep2": ("ddp", 2, "2", ["--ep_size", "2", *COMPILE])}


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return {**launch_cases(DENSE, base_model, root), **launch_cases(EP, base_model, root, common=[*COMMON, *MOE])}


@pytest.mark.parametrize("case", list(DENSE))
def test_compiled_matches_eager_single(runs, single_run, base_weights, case):
    assert_steps_match(single_run, runs[case], f"compiled {case}")
    assert_export_matches(single_run, runs[case], f"compiled {case}", initial=base_weights)
    assert read_run_info(runs[case])["torch_compile"]["regions"] == 4


@pytest.fixture(scope="module")
def inductor_run(base_model, tmp_path_factory):
    """One process compiled with inductor (C++ kernels built by g++ on the CPU): the backend users get by default."""
    cases = {"inductor": ("single", 1, "4", ["--torch_compile", "--torch_compile_backend", "inductor"])}
    return launch_cases(cases, base_model, tmp_path_factory.mktemp("inductor"))["inductor"]


def test_inductor_matches_eager_single(inductor_run, single_run, base_weights):
    """inductor generates its own kernels (fused, reordered reductions): the contract's 1e-4 still holds."""
    assert_steps_match(single_run, inductor_run, "compiled single (inductor)")
    assert_export_matches(single_run, inductor_run, "compiled single (inductor)", initial=base_weights)
    info = read_run_info(inductor_run)["torch_compile"]
    assert info["regions"] == 4 and info["backend"] == "inductor", info


def test_compiled_ep_matches_eager_ep(runs):
    assert_steps_match(runs["ep2_eager"], runs["ep2"], "compiled ep2")
    assert_export_matches(runs["ep2_eager"], runs["ep2"], "compiled ep2")
    assert read_run_info(runs["ep2"])["torch_compile"]["regions"] == 4
