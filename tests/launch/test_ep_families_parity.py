"""Expert parallelism of native MoE families through the sft recipe (`--ep_size 2`), their HF blocks kept as HF's code
with only the experts sharded (hfpar.parallel.expert_parallel.hf_experts), against the same model in one process.

fp32, 8 steps, accumulation 2, clipping on (tests/helpers/parity.py COMMON), global batch 8: tiny checkpoints built from
configs (random init, the embedded tokenizer) of
    deepseek_v3     sigmoid scores with a random e_score_correction_bias, group-limited top-k (2 groups, 1 kept),
                    routed scaling 2.5, a shared expert, a dense first layer
    gpt_oss         transposed experts with biases, clamped SwiGLU, a router with a bias, sliding / full attention
    ernie4_5_moe    moe_statics.e_score_correction_bias, a shared expert (refused even without --ep_size before)
    dbrx            experts stacked as 2-D row blocks (w1 / v1 / w2 (E * F, H)) in a child GLU module, rows handed
                    to the experts unflattened (B, T, H), router jitter off (the tiny copy zeroes it)
    longcat_flash   zero-computation (identity) experts: routed indices 4, 5 of 6 run no weights, where the token
                    is; gate_up_proj's rows for them split over the ranks as a second packed part (sharded loading,
                    export)
each trained once in one process and once with EP=2 under DDP (DeepSeek-V3, Ernie-4.5-MoE and GPT-OSS, whose attention
sinks CP now computes, also with EP=2 x CP=2, EP drawn from the cp ranks): loss and grad_norm per step within 1e-4
relative, and the exported checkpoint (experts gathered back, HF names) within 1e-4 of the one-process one. Two
launches (the one-process runs, the EP=2 runs), shared by every assertion.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.ep_models import save_tiny_moe
from tests.helpers.launch import RECIPE_RUNS, launch_all, read_run_info
from tests.helpers.parity import COMMON, assert_export_matches, assert_steps_match
from tests.helpers.shared import built_once

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # on demand: -m extended (docs/testing.md)

FAMILIES = {
    "deepseek_v3": {
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
    },
    "gpt_oss": {"layer_types": ["sliding_attention", "full_attention"]},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 0},
    "dbrx": {},
    "longcat_flash": {},
}


EP_CP = ("deepseek_v3", "ernie4_5_moe", "gpt_oss")  # GPT-OSS: attention sinks under CP


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches in all, running their families one after the other in the same workers
    (tests/helpers/recipe_runs.py: the start-up paid once)."""

    def build(root):
        cases, specs = {}, {"single": [], "ep2": []}
        for mt, over in FAMILIES.items():
            model = save_tiny_moe(mt, root / f"{mt}_model", **over)
            kinds = [("single", "4", []), ("ep2", "2", ["--ep_size", "2"])]
            if mt in EP_CP:  # EP=2 drawn from the cp ranks (dp 1): in the ep2 launch (same config, processes)
                kinds.append(("ep2_cp2", "4", ["--ep_size", "2", "--cp_size", "2", "--save_steps", "0"]))
            for kind, bs, extra in kinds:
                cases[f"{mt}_{kind}"] = str(root / f"{mt}_{kind}")
                specs["single" if kind == "single" else "ep2"].append(
                    [
                        *COMMON,
                        *extra,
                        "--model_name_or_path",
                        model,
                        "--output_dir",
                        cases[f"{mt}_{kind}"],
                        "--per_device_train_batch_size",
                        bs,
                    ]
                )
        for kind, argvs in specs.items():
            (root / f"{kind}.json").write_text(json.dumps({"kind": "sft", "runs": argvs}))
        launch_all(
            {
                "single": ("single", 1, RECIPE_RUNS, [str(root / "single.json")]),
                "ep2": ("ddp", 2, RECIPE_RUNS, [str(root / "ep2.json")]),
            }
        )
        return cases

    return built_once(tmp_path_factory, "ep_families", build)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_ep2_matches_single_per_step_and_export(runs, model_type):
    from pathlib import Path

    single, ep2 = Path(runs[f"{model_type}_single"]), Path(runs[f"{model_type}_ep2"])
    assert_steps_match(single, ep2, model_type, tokens=False)
    assert_export_matches(single, ep2, model_type)


@pytest.mark.parametrize("model_type", EP_CP)
def test_ep2_cp2_matches_single_per_step_and_export(runs, model_type):
    """EP x CP with the HF blocks' own routers (cp auto: Ulysses where the heads divide, else ring)."""
    from pathlib import Path

    single, got_dir = Path(runs[f"{model_type}_single"]), Path(runs[f"{model_type}_ep2_cp2"])
    assert_steps_match(single, got_dir, f"{model_type} ep2 x cp2")
    assert_export_matches(single, got_dir, f"{model_type} ep2 x cp2")
    info = read_run_info(got_dir)
    assert (info["ep_size"], info["cp_size"]) == (2, 2), info


@pytest.mark.parametrize("model_type", FAMILIES)
def test_ep2_ranks_hold_half_the_experts(runs, model_type):
    one = read_run_info(runs[f"{model_type}_single"])["param_bytes_per_rank"][0]
    two = read_run_info(runs[f"{model_type}_ep2"])["param_bytes_per_rank"]
    assert len(two) == 2 and all(b < one for b in two), (one, two)
