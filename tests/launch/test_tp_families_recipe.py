"""`--tp_size 2` through the sft recipe on families hfpar has no written plan for, under the parity contract (fp32,
8 steps, accumulation 2, clipping active; loss and grad norm per step within 1e-4 of the one-process run), and the
export of each run: a normal HF checkpoint that loads with from_pretrained and equals the one-process weights.

    olmo2          head-spanning q/k RMSNorms sharded (ShardedRMSNorm), plan derived from base_model_tp_plan
    qwen3_5_text   gated-DeltaNet linear attention kept whole, full attention and MLP sharded (4 layers)
    deepseek_v2    multi-head latent attention (latent down-projections replicated) next to MoE blocks
    falcon         plan inferred from the modules: fused per-head query_key_value in FalconLinear layers
    gpt_bigcode    plan inferred from the modules (StarCoder): fused c_attn

and TP=2 with --sequence_parallel where the family allows it (OLMo-2, Falcon, GPT-BigCode: sequence_plan.py; Qwen3.5's
linear attention kept whole and DeepSeek-V2's MoE blocks see the full sequence, so hfpar refuses it for them).

Tiny models built from configs (benchmarks/tensor_parallel/family_sweep.py tiny_config, vocab 128 = the embedded
tokenizer's), one module fixture: per family one one-process reference, one TP=2 run (and one TP=2 + SP run), in two
launches. In the recipe TP is applied to the meta skeleton of the sharded loading: every plan (written, derived,
inferred) is verified there on a tiny float64 copy of the model (hfpar.parallel.tensor_parallel.tiny_check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.launch import RECIPE_RUNS, launch_all, read_metrics, rel_close
from tests.helpers.parity import (
    COMMON,
    TOL,
    assert_close_series,
    assert_export_matches,
    export_eval_loss,
)
from tests.helpers.tiny_configs import save_tiny

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # on demand: -m extended (docs/testing.md)

FAMILIES = {"olmo2": 2, "qwen3_5_text": 4, "deepseek_v2": 2, "falcon": 2, "gpt_bigcode": 2}  # model_type: layers
SP = ("olmo2", "falcon", "gpt_bigcode")
CASES = [(mt, "tp2") for mt in FAMILIES] + [(mt, "tp2_sp") for mt in SP]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{model_type: (base model dir, one-process run, {case: TP=2 run})}: two launches in all, each running its
    runs one after the other in the same workers (tests/helpers/recipe_runs.py: the start-up paid once)."""
    root = tmp_path_factory.mktemp("tp_families")
    out, specs = {}, {"single": [], "tp2": []}
    for mt, layers in FAMILIES.items():
        base = save_tiny(mt, layers, root / mt / "base")
        out[mt] = (base, root / mt / "single", {"tp2": root / mt / "tp2", "tp2_sp": root / mt / "tp2_sp"})
        common = [*COMMON, "--model_name_or_path", base, "--per_device_train_batch_size", "4"]
        specs["single"].append([*common, "--output_dir", str(out[mt][1])])
        specs["tp2"].append([*common, "--tp_size", "2", "--output_dir", str(out[mt][2]["tp2"])])
        if mt in SP:
            specs["tp2"].append(
                [*common, "--tp_size", "2", "--sequence_parallel", "--output_dir", str(out[mt][2]["tp2_sp"])]
            )
    for key, argvs in specs.items():
        (root / f"{key}.json").write_text(json.dumps({"kind": "sft", "runs": argvs}))
    launch_all(
        {
            "single": ("single", 1, RECIPE_RUNS, [str(root / "single.json")]),
            "tp2": ("ddp", 2, RECIPE_RUNS, [str(root / "tp2.json")]),
        }
    )
    return out


@pytest.mark.parametrize("model_type, case", CASES)
def test_tp2_matches_single_per_step(runs, model_type, case):
    _, single, tp = runs[model_type]
    ref, _ = read_metrics(single)
    got, _ = read_metrics(tp[case])
    assert len(got) == 8
    assert_close_series(ref, got, "loss", TOL, f"{model_type} {case}")
    assert_close_series(ref, got, "grad_norm", TOL, f"{model_type} {case}")


@pytest.mark.parametrize("model_type, case", CASES)
def test_tp2_export_loads_and_equals_single(runs, model_type, case):
    base, single, tp = runs[model_type]
    assert_export_matches(
        single, tp[case], f"{model_type} {case}", initial=load_file(str(Path(base) / "model.safetensors"))
    )
    _, evals = read_metrics(tp[case])
    assert rel_close(export_eval_loss(tp[case]), evals[-1]["eval_loss"], 1e-4)  # from_pretrained on one process
