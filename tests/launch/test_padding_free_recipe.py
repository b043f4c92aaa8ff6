"""The recipe with padded batches reproduces the default padding-free run (the batches themselves:
tests/unit/test_padding_free.py), and one-row batches through hfpar_varlen (tests/unit/test_varlen_attention.py)
reproduce it too: in one process, with --packing, under DDP and under TP=2 with sequence parallelism.

python -m pytest -q -p no:cacheprovider tests/launch/test_padding_free_recipe.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfpar import data
from hfpar.train.sampler import GlobalBatchSampler
from tests.helpers.launch import launch_all, read_metrics, read_run_info, rel_close
from tests.helpers.parity import COMMON
from tests.helpers.tiny_configs import save_tiny

VARLEN = ["--attn_implementation", "hfpar_varlen"]
CASES = {  # name: (accelerate config, processes, extra argv)
    "padded": ("single", 1, ["--per_device_train_batch_size", "4", "--padding_free", "false"]),
    "varlen": ("single", 1, ["--per_device_train_batch_size", "4", *VARLEN]),
    "packed": ("single", 1, ["--per_device_train_batch_size", "2", "--packing"]),
    "packed_varlen": ("single", 1, ["--per_device_train_batch_size", "2", "--packing", *VARLEN]),
    "ddp_varlen": ("ddp", 2, ["--per_device_train_batch_size", "2", *VARLEN]),
    "tp_sp_varlen": (
        "ddp",
        2,
        ["--per_device_train_batch_size", "4", "--tp_size", "2", "--sequence_parallel", *VARLEN],
    ),
}


# a family the packing check admits by what its code does (no list names it): Cohere-2's sliding-window layers with
# RoPE and a global layer without it (4 layers hold one), LayerNorm, parallel attention and MLP, scaled logits
OTHER = "cohere2"
BS4 = ["--per_device_train_batch_size", "4"]
OTHER_CASES = {OTHER: BS4, f"{OTHER}_padded": [*BS4, "--padding_free", "false"]}


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("padding_free")
    other = save_tiny(OTHER, 4, root / f"{OTHER}_base")
    specs = {
        name: ("single", 1, "sft", [*COMMON, "--model_name_or_path", other, "--output_dir", str(root / name), *extra])
        for name, extra in OTHER_CASES.items()
    }
    for name, (cfg, n, extra) in CASES.items():
        argv = [*COMMON, "--model_name_or_path", base_model, "--output_dir", str(root / name), *extra]
        specs[name] = (cfg, n, "sft", argv)
    launch_all(specs)
    return root


def _same_training(a: Path, b: Path, tol: float) -> None:
    steps_a, eval_a = read_metrics(a)
    steps_b, eval_b = read_metrics(b)
    assert len(steps_a) == len(steps_b) == 8
    for x, y in zip(steps_a, steps_b):
        assert rel_close(x["loss"], y["loss"], tol) and rel_close(x["grad_norm"], y["grad_norm"], tol), (x, y)
        assert x["num_target_tokens"] == y["num_target_tokens"]
        # real tokens: no padding counted in either layout
        assert round(x["tokens_per_s"] * x["step_time_s"]) == round(y["tokens_per_s"] * y["step_time_s"])
    assert rel_close(eval_a[-1]["eval_loss"], eval_b[-1]["eval_loss"], tol)


@pytest.mark.slow
def test_padded_batches_reproduce_the_default_run(single_run, runs, base_model):
    """One process, 8 steps: --padding_free false gives the default run's losses and grad norms (1e-5), the same
    target tokens per step, and the same real-token count (tokens_per_s counts no padding in either layout)."""
    assert read_run_info(single_run)["padding_free"] is True and read_run_info(runs / "padded")["padding_free"] is False
    _same_training(Path(single_run), runs / "padded", 1e-5)
    free, _ = read_metrics(single_run)
    # step 1's real tokens, counted from the samples the sampler gives it
    tok = data.load_tokenizer(base_model)
    train, _ = data.tokenize_sft(data.load_splits(None, "sft", eval_split_fraction=0.05, seed=42)["train"], tok, 128)
    micro = GlobalBatchSampler(len(train), 4, 1, 0, 2, 42).micro_batches(0, 0)
    real = sum(len(train[i]["input_ids"]) for ix in micro for i in ix)
    assert round(free[0]["tokens_per_s"] * free[0]["step_time_s"]) == real


@pytest.mark.slow
def test_one_row_varlen_runs_reproduce_the_padding_free_runs(single_run, runs):
    """hfpar_varlen's one-row micro-batches train like the default rows of <= 128 tokens (sdpa, block-diagonal
    mask), 1e-5 over 8 steps: one process, under DDP (2 x 2 rows), under TP=2 + SP (the row padded to a multiple of
    2, each pad its own sample); and --packing's rows joined into one row train like the packed rows themselves."""
    for name in ("varlen", "ddp_varlen", "tp_sp_varlen", "packed_varlen"):
        info = read_run_info(runs / name)
        assert info["padding_free"] is True and info["one_row"] is True, (name, info)
    assert read_run_info(single_run)["one_row"] is False and read_run_info(runs / "packed")["padding_free"] is False
    for name in ("varlen", "ddp_varlen", "tp_sp_varlen"):
        _same_training(Path(single_run), runs / name, 1e-5)
    _same_training(runs / "packed", runs / "packed_varlen", 1e-5)


@pytest.mark.slow
def test_a_family_no_list_names_trains_padding_free(runs):
    """Cohere-2 (outside the 14 families padding-free rows once applied to): its tiny copy keeps packed samples
    apart, so the default run packs its rows, and trains as the padded run does (8 steps, 1e-5)."""
    assert read_run_info(runs / OTHER)["padding_free"] is True
    assert read_run_info(runs / f"{OTHER}_padded")["padding_free"] is False
    _same_training(runs / OTHER, runs / f"{OTHER}_padded", 1e-5)
