"""`recipes/classify.py --tp_size 2` on encoder classifiers hfpar has no written plan for, under the parity contract
(fp32, 8 steps, accumulation 2, clipping active; loss and grad norm per step within 1e-4 of the one-process run, the
same eval accuracy) and the export of each run: a sequence classifier that loads with from_pretrained and equals the
one-process weights.

    roberta      BERT's layout (attention.self / attention.output.dense, intermediate / output.dense), padding-offset
                 learned positions; the plan is inferred (infer.py _split_regions) and verified on the meta skeleton's
                 tiny float64 copy before any weight is read
    deberta-v2   disentangled attention (relative position embeddings shared by every layer, query_proj / key_proj /
                 value_proj)
    distilbert   q_lin / k_lin / v_lin / out_lin and lin1 / lin2, a pre-classifier Linear

Tiny models from each family's default config (hfpar.parallel.tiny_copy.shrink, dropout off, 4 labels, vocab 128 =
the embedded tokenizer's), one module fixture: two launches (one process, TP=2), each running its runs one after the
other (tests/helpers/recipe_runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification

from hfpar import data
from hfpar.parallel.tiny_copy import shrink
from tests.helpers.launch import launch_all, read_metrics
from tests.helpers.parity import COMMON, TOL, assert_close_series, assert_export_matches

pytestmark = pytest.mark.slow

FAMILIES = ("roberta", "deberta-v2", "distilbert")
KEY_BIASES = ("key.bias", "key_proj.bias", "k_lin.bias")  # zero gradients in exact arithmetic (assert_export_matches)


def save_classifier(model_type: str, path: Path) -> str:
    cfg = shrink(AutoConfig.for_model(model_type), 2, keep=False)
    cfg.update({"num_labels": 4, "vocab_size": 128, "pad_token_id": 0, "max_position_embeddings": 160})
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{model_type: (base dir, one-process run, TP=2 run)}; launch_all runs the jobs of one accelerate config in one
    launch (tests/helpers/recipe_runs.py)."""
    root = tmp_path_factory.mktemp("tp_classify")
    out, jobs = {}, {}
    for mt in FAMILIES:
        base = save_classifier(mt, root / mt / "base")
        out[mt] = (base, root / mt / "single", root / mt / "tp2")
        common = [*COMMON, "--model_name_or_path", base, "--per_device_train_batch_size", "4"]
        jobs[f"{mt}_single"] = ("single", 1, "classify", [*common, "--output_dir", str(out[mt][1])])
        jobs[f"{mt}_tp2"] = ("ddp", 2, "classify", [*common, "--tp_size", "2", "--output_dir", str(out[mt][2])])
    launch_all(jobs)
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tp2_classifier_matches_single_per_step(runs, model_type):
    _, single, tp = runs[model_type]
    (ref, ref_eval), (got, got_eval) = read_metrics(single), read_metrics(tp)
    assert len(got) == 8
    assert_close_series(ref, got, "loss", TOL, f"{model_type} tp2")
    assert_close_series(ref, got, "grad_norm", TOL, f"{model_type} tp2")
    assert [e["eval_accuracy"] for e in got_eval] == [e["eval_accuracy"] for e in ref_eval]
    assert_close_series(ref_eval, got_eval, "eval_loss", TOL, f"{model_type} tp2 eval")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tp2_classifier_export_loads_and_equals_single(runs, model_type):
    base, single, tp = runs[model_type]
    initial = load_file(str(Path(base) / "model.safetensors"))
    assert_export_matches(single, tp, f"{model_type} tp2", initial=initial, noise_only=KEY_BIASES)
    model = AutoModelForSequenceClassification.from_pretrained(tp)
    assert model.config.model_type == model_type and model.config.num_labels == 4
