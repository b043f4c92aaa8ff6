"""The suite's ranks fork from pre-imported zygotes (tests/helpers/rank_zygote.py): a recipe launch so run trains
bit-for-bit what the same launch with fresh interpreters trains (HFPAR_TEST_RANKS=fresh), and its ranks were
forked (the zygotes' decision log), so the suite's launches keep the speed-up (tests/unit/test_rank_fork.py checks
the mechanism: exit codes, signals, environment)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.launch import _ZYGOTE, launch, read_metrics
from tests.helpers.parity import COMMON

pytestmark = pytest.mark.slow


# single: Accelerate sets CUDA_VISIBLE_DEVICES for its rank; zero2 (2 ranks, as DDP's are forked): DeepSpeed's
# launch sets PYTHONPATH (the working directory) and PYTORCH_NVML_BASED_CUDA_CHECK: forked where they cannot change
# an import (rank_zygote.refusal)
@pytest.mark.parametrize(("config", "nproc"), [("single", 1), ("zero2", 2)])
def test_forked_ranks_train_what_fresh_interpreters_train(base_model, tmp_path, config, nproc):
    forks = _ZYGOTE.rank_forks().count(" fork ")
    runs = {}
    for mode in ("forked", "fresh"):
        runs[mode] = tmp_path / mode
        args = [*COMMON, "--model_name_or_path", base_model, "--output_dir", str(runs[mode])]
        extra = {"HFPAR_TEST_RANKS": "fresh"} if mode == "fresh" else None
        launch(config, nproc, "sft", [*args, "--per_device_train_batch_size", str(4 // nproc)], extra_env=extra)
        assert _ZYGOTE.rank_forks().count(" fork ") == forks + nproc, _ZYGOTE.rank_forks()  # fresh: forks none
    forked, fresh = (read_metrics(runs[m])[0] for m in ("forked", "fresh"))
    assert len(forked) == 8 and [(r["loss"], r["grad_norm"]) for r in forked] == [
        (r["loss"], r["grad_norm"]) for r in fresh
    ]
    weights = [Path(runs[m], "model.safetensors").read_bytes() for m in ("forked", "fresh")]
    assert weights[0] == weights[1]
