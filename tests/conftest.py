"""Session fixtures: one saved tiny base model and one single-process reference run per session, the backend runs
shared by the parity, plan and reliability tests. Helpers live in tests/helpers/, not here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import launch
from tests.helpers.parity import BACKENDS, COMMON, launch_cases


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2`, `--dist loadgroup` from pyproject's addopts) a test module runs on one worker,
    so its module fixtures are built once; the modules sharing the session's `backend_runs` (six launches) run on
    one worker together, so those launches are not repeated per worker."""
    shared = {item.module.__name__ for item in items if "backend_runs" in getattr(item, "fixturenames", ())}
    for item in items:
        module = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("backend_runs" if module in shared else module))


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """A saved random-init tiny Llama + tokenizer, so every strategy (ZeRO-3 zero.Init included) loads the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar import data

    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def base_weights(base_model) -> dict[str, torch.Tensor]:
    """The base model's weights: what every dense run starts training from (assert_export_matches' initial)."""
    return load_file(str(Path(base_model) / "model.safetensors"))


@pytest.fixture(scope="session")
def single_run(base_model, tmp_path_factory):
    """The reference: one process, batch 4 x accumulation 2."""
    out = tmp_path_factory.mktemp("runs") / "single"
    launch("single", 1, "sft", [*COMMON, "--model_name_or_path", base_model, "--output_dir", str(out),
                                "--per_device_train_batch_size", "4"])
    return out


@pytest.fixture(scope="session")
def backend_runs(base_model, single_run, tmp_path_factory) -> dict:
    """{"single": ..., strategy: output_dir}: each data-parallel backend on 2 processes, batch 2 x dp 2 x
    accumulation 2, checkpoints at steps 4 and 8. Shared by the parity, plan-estimate and reliability tests.
    Two launches at a time: much of a launch is process start-up and rendezvous, which overlap well."""
    root = tmp_path_factory.mktemp("backends")
    return {"single": single_run, **launch_cases({name: (name, 2, "2", []) for name in BACKENDS}, base_model, root)}
