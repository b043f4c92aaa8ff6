"""mixed_precision fp8 (hfpar/precision/fp8.py): its settings, one-line refusals and the model conversion, in process.

python -m pytest -q tests/unit/test_fp8.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar import data
from hfpar.backends import STRATEGY
from hfpar.context import ParallelContext
from hfpar.precision import fp8
from hfpar.train.compile import repeated_blocks
from tests.helpers.preflight import _args
from tests.helpers.tiny_configs import MOE, TINY

CPU = torch.device("cpu")


@pytest.fixture
def fp8_env(monkeypatch):
    """What `accelerate launch --mixed_precision fp8` exports, with the CPU emulation switch."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    for var in ("ACCELERATE_FP8_RECIPE", "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "ACCELERATE_FP8_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _problems(*argv, world=1, strategy="single", device=CPU, **degrees):
    return fp8.fp8_problems(_args(*argv), ParallelContext.plan(world, **degrees), STRATEGY[strategy], device)


def test_recipe_from_flag_then_config_then_default(fp8_env):
    assert fp8.fp8_settings(_args()).recipe == "tensorwise"  # torchao's default
    assert fp8.fp8_settings(_args()).fsdp_float8_all_gather  # Accelerate's fp8_config default, under FSDP2
    assert not fp8.fp8_settings(_args(), all_gather=False).fsdp_float8_all_gather  # not FSDP2 (or with TP)
    fp8_env.setenv("ACCELERATE_FP8_RECIPE", "rowwise")  # the accelerate config's fp8_config: recipe: rowwise
    s = fp8.fp8_settings(_args())
    assert (s.recipe, s.fsdp_float8_all_gather) == ("rowwise", False)  # torchao all-gathers tensorwise scales only
    assert fp8.fp8_settings(_args("--fp8_recipe", "tensorwise")).recipe_from == "--fp8_recipe"  # the flag wins
    assert _problems() == []
    fp8_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert fp8.fp8_settings(_args()) is None


def test_refusals_are_one_line_naming_the_value(fp8_env):
    (line,) = _problems("--fp8_recipe", "blockwise")
    assert "'blockwise'" in line and "--fp8_recipe" in line and "tensorwise, rowwise" in line
    fp8_env.delenv(fp8.EMULATE_ENV)
    (line,) = _problems()
    assert line.startswith("mixed_precision fp8 on CPU:") and f"{fp8.EMULATE_ENV}=1" in line
    fp8_env.setenv("ACCELERATE_FP8_BACKEND", "TE")
    assert any("backend TE" in x and "backend: AO" in x for x in _problems())
    fp8_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    (line,) = _problems("--fp8_recipe", "rowwise")
    assert line.startswith("--fp8_recipe rowwise: needs mixed_precision fp8")


def test_gpu_below_sm89_is_refused(fp8_env, monkeypatch):
    fp8_env.delenv(fp8.EMULATE_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    (line,) = _problems(device=torch.device("cuda", 0))
    assert "NVIDIA A100 (compute capability 8.0)" in line and "8.9" in line and "bf16" in line
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert _problems(device=torch.device("cuda", 0)) == []


def test_torchao_missing_names_the_install(fp8_env, monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name, *a))
    (line,) = _problems()
    assert "torchao" in line and "pip install torchao" in line


def test_compositions_refused_before_the_model_loads(fp8_env):
    assert _problems("--tp_size", "2", world=2, tp=2) == []
    assert _problems(world=2, strategy="fsdp2") == []
    for argv, degrees in (
        (("--ep_size", "2", "--upcycle_experts", "4"), {"ep": 2}),
        (("--cp_size", "2"), {"cp": 2}),
        (("--pp_size", "2"), {"pp": 2}),
    ):
        (line,) = _problems(*argv, world=2, **degrees)
        assert line.startswith(f"mixed_precision fp8 with {argv[0]} 2: not supported") and "bf16" in line
    (line,) = _problems(world=2, strategy="zero2")
    assert line.startswith("mixed_precision fp8 with zero2 (DeepSpeed): not supported")
    (line,) = _problems("--use_peft")
    assert line.startswith("mixed_precision fp8 with --use_peft: not supported")


def _tiny(model_type: str, **kw):
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **kw}))


def test_conversion_keeps_head_embeddings_routers_and_odd_dims(fp8_env):
    pytest.importorskip("torchao")
    s = fp8.fp8_settings(_args("--fp8_recipe", "rowwise"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))
    info = fp8.convert_model(model, s, repeated_blocks(model))
    assert (info["layers"], info["per_block"], info["skipped"]) == (28, 7, [])
    assert type(model.lm_head) is torch.nn.Linear  # the head and the embeddings stay as they are
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"
    # dims 32 / 64: q (32, 32) qualifies, k / v (16, 32) too; a MoE model's router stays as it is
    moe = _tiny("qwen2_moe", **MOE, shared_expert_intermediate_size=32)
    info = fp8.convert_model(moe, s, repeated_blocks(moe))
    names = {n for n, m in moe.named_modules() if type(m).__name__ == "Float8Linear"}
    assert not any(n.endswith(".gate") or "shared_expert_gate" in n for n in names), names
    assert any("shared_expert_gate" in x for x in info["skipped"]), info  # (1, 32): not a multiple of 16
    odd = _tiny("llama", hidden_size=24, head_dim=6, intermediate_size=40)
    with pytest.raises(ValueError, match="no Linear layer of LlamaForCausalLM's decoder blocks can run in fp8"):
        fp8.convert_model(odd, s, repeated_blocks(odd))


def test_fp8_config_keys_are_checked(tmp_path):
    """fp8_config keys are the launcher's FP8 arguments and hfpar's `recipe`; the shipped config uses only those."""
    from hfpar.backends.launch_config import config_problems
    from tests.helpers.launch import ROOT

    assert config_problems(ROOT / "accelerate_configs" / "fsdp2_fp8.yaml") == []
    cfg = tmp_path / "fp8.yaml"
    cfg.write_text("mixed_precision: fp8\nfp8_config:\n  backend: AO\n  recipie: rowwise\n")
    (line,) = config_problems(cfg)
    assert "fp8_config: unknown key 'recipie'" in line and "did you mean 'fp8_recipe'?" in line
