"""The recipe with padded batches reproduces the default padding-free run (the batches themselves:
tests/unit/test_padding_free.py).

python -m pytest -q -p no:cacheprovider tests/launch/test_padding_free_recipe.py
"""

from __future__ import annotations

import pytest

from hfpar import data
from hfpar.train.sampler import GlobalBatchSampler
from tests.helpers.launch import launch, read_metrics, read_run_info, rel_close
from tests.helpers.parity import COMMON


# ---------------------------------------------------------------------------------------- the recipe
@pytest.mark.slow
def test_padded_batches_reproduce_the_default_run(single_run, base_model, tmp_path):
    """One process, 8 steps: --padding_free false gives the default run's losses and grad norms (1e-5), the same
    target tokens per step, and the same real-token count (tokens_per_s counts no padding in either layout)."""
    out = tmp_path / "padded"
    launch(
        "single",
        1,
        "sft",
        [
            *COMMON,
            "--model_name_or_path",
            base_model,
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "4",
            "--padding_free",
            "false",
        ],
    )
    free, free_eval = read_metrics(single_run)
    padded, padded_eval = read_metrics(out)
    assert read_run_info(single_run)["padding_free"] is True and read_run_info(out)["padding_free"] is False
    assert len(free) == len(padded) == 8
    for f, p in zip(free, padded):
        assert rel_close(f["loss"], p["loss"], 1e-5) and rel_close(f["grad_norm"], p["grad_norm"], 1e-5), (f, p)
        assert f["num_target_tokens"] == p["num_target_tokens"]
        assert round(f["tokens_per_s"] * f["step_time_s"]) == round(p["tokens_per_s"] * p["step_time_s"])
    assert rel_close(free_eval[-1]["eval_loss"], padded_eval[-1]["eval_loss"], 1e-5)
    # step 1's real tokens, counted from the samples the sampler gives it
    tok = data.load_tokenizer(base_model)
    train, _ = data.tokenize_sft(data.load_splits(None, "sft", eval_split_fraction=0.05, seed=42)["train"], tok, 128)
    micro = GlobalBatchSampler(len(train), 4, 1, 0, 2, 42).micro_batches(0, 0)
    real = sum(len(train[i]["input_ids"]) for ix in micro for i in ix)
    assert round(free[0]["tokens_per_s"] * free[0]["step_time_s"]) == real
