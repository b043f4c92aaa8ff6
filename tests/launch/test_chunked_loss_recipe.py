"""The recipe's default chunked LM loss equals --loss_chunk_size 0 per step (the function, the families and the
vocab-parallel head: tests/distributed/test_chunked_loss.py).

    python -m pytest -q -p no:cacheprovider tests/launch/test_chunked_loss_recipe.py
"""

from __future__ import annotations

import pytest

from tests.helpers.launch import launch, read_metrics, read_run_info, rel_close
from tests.helpers.parity import COMMON


# ------------------------------------------------------------------------------------------ the recipe
@pytest.mark.slow
def test_recipe_default_chunked_equals_unchunked(single_run, base_model, tmp_path):
    out = tmp_path / "unchunked"
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
            "--loss_chunk_size",
            "0",
        ],
    )
    assert read_run_info(single_run)["loss_chunk_size"] == "auto" and read_run_info(out)["loss_chunk_size"] == 0
    chunked, chunked_eval = read_metrics(single_run)
    plain, plain_eval = read_metrics(out)
    assert len(chunked) == len(plain) == 8
    for c, p in zip(chunked, plain):
        assert rel_close(c["loss"], p["loss"], 1e-6) and rel_close(c["grad_norm"], p["grad_norm"], 1e-5), (c, p)
    assert rel_close(chunked_eval[-1]["eval_loss"], plain_eval[-1]["eval_loss"], 1e-6)
