"""Session fixtures: one saved tiny base model and one single-process reference run per session, the backend runs
shared by the parity, plan and reliability tests; each built once per test run even on several pytest-xdist workers
(tests/helpers/shared.py). Helpers live in tests/helpers/, not here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import launch
from tests.helpers.parity import BACKENDS, COMMON, RESUMED_BACKENDS, launch_cases
from tests.helpers.reliability import run_args
from tests.helpers.shared import built_once

# One thread in the pytest workers and the processes they start (a launch's own OMP_NUM_THREADS=1): the suite runs
# two workers on two cores, each next to the other's launches, and two OpenMP threads on a loaded core spin-wait
# rather than compute (measured: tests/unit/test_grpo_objective.py 5 s alone, 300 s beside launches with two threads)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# the suite's tiny models train with their recipe's embedded-run options beneath each test's own flags, as they did
# before those options became the no-model run's only (hfpar.config.DEMO_ENV; tests/unit/test_config.py checks both)
os.environ.setdefault("HFPAR_DEMO_OPTIONS", "always")


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """A saved random-init tiny Llama + tokenizer, so every strategy (ZeRO-3 zero.Init included) loads the same
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar import data

    def build(path: Path) -> str:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))
        model.save_pretrained(path)
        data.load_tokenizer(None).save_pretrained(path)
        return str(path)

    return built_once(tmp_path_factory, "base", build)


@pytest.fixture(scope="session")
def base_weights(base_model) -> dict[str, torch.Tensor]:
    """The base model's weights: what every dense run starts training from (assert_export_matches' initial)."""
    return load_file(str(Path(base_model) / "model.safetensors"))


@pytest.fixture(scope="session")
def single_run(base_model, tmp_path_factory):
    """The reference: one process, batch 4 x accumulation 2."""

    def build(root: Path) -> str:
        launch(
            "single",
            1,
            "sft",
            [
                *COMMON,
                "--model_name_or_path",
                base_model,
                "--output_dir",
                str(root / "single"),
                "--per_device_train_batch_size",
                "4",
            ],
        )
        return str(root / "single")

    return Path(built_once(tmp_path_factory, "runs", build))


@pytest.fixture(scope="session")
def ddp_reference(base_model, tmp_path_factory) -> Path:
    """The uninterrupted 16-step DDP run (2 processes) that the reliability tests interrupt and resume
    (tests/helpers/reliability.py); shared by test_reliability.py and test_slurm.py."""

    def build(root: Path) -> str:
        launch("ddp", 2, "sft", run_args(base_model, root / "uninterrupted"))
        return str(root / "uninterrupted")

    return Path(built_once(tmp_path_factory, "reliability", build))


@pytest.fixture(scope="session")
def backend_runs(base_model, single_run, tmp_path_factory) -> dict:
    """{"single": ..., strategy: output_dir}: each data-parallel backend on 2 processes, batch 2 x dp 2 x
    accumulation 2, checkpoints at steps 4 and 8. Shared by the parity, plan-estimate and reliability tests.
    Two launches at a time: much of a launch is process start-up and rendezvous, which overlap well."""

    def build(root: Path) -> dict:
        return {
            name: str(out)
            for name, out in launch_cases(
                {name: (name, 2, "2", []) for name in BACKENDS}, base_model, root, resume=RESUMED_BACKENDS
            ).items()
        }

    return {
        "single": single_run,
        **{name: Path(out) for name, out in built_once(tmp_path_factory, "backends", build).items()},
    }
