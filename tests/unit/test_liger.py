"""--use_liger_kernel (hfpar/train/liger.py): refused in one line before the model loads where it cannot run (no CUDA,
no package, a family Liger has no kernels for, hfpar's model-parallel layers); with data parallelism on CUDA it calls
Liger's own per-family function with the kernels that function takes, never Liger's loss kernels.

Liger's kernels are Triton GPU kernels: on this CPU machine the package is stood in for by a module that records the
call (the refusals and the arguments are what hfpar decides; the kernels' results are measured on a GPU by
benchmarks/gpu/peers.py's hfpar_liger variant: docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.train import liger
from tests.helpers.launch import ROOT, env
from tests.helpers.preflight import _args, _model_dir

ONE = SimpleNamespace(tp=1, ep=1, cp=1, pp=1)


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in liger_kernel package: Llama's function (its real signature), the instance entry point recording."""
    calls = []

    def apply_liger_kernel_to_llama(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        pass

    def instance(model, **kw):
        calls.append((model, kw))

    mp = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mp.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama}
    tr = types.ModuleType("liger_kernel.transformers")
    tr._apply_liger_kernel_to_instance = instance
    pkg = types.ModuleType("liger_kernel")
    pkg.__spec__ = SimpleNamespace(name="liger_kernel")
    for name, mod in (
        ("liger_kernel", pkg),
        ("liger_kernel.transformers", tr),
        ("liger_kernel.transformers.monkey_patch", mp),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    return calls


def test_without_the_flag_nothing_is_checked():
    assert liger.liger_problems(_args(), ONE, "cpu", None) == []


def test_refused_without_cuda_or_without_the_package(monkeypatch):
    (line,) = liger.liger_problems(_args("--use_liger_kernel"), ONE, "cpu", None)
    assert "Triton GPU kernels" in line and "CPU" in line and "\n" not in line
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    (line,) = liger.liger_problems(_args("--use_liger_kernel"), ONE, "cuda", None)
    assert line.endswith("(pip install liger-kernel)")


@pytest.mark.parametrize("flag", ["--tp_size", "--ep_size", "--cp_size", "--pp_size"])
def test_refused_beside_hfpars_model_parallel_layers(fake_liger, flag):
    ctx = SimpleNamespace(**{**vars(ONE), flag[2:4]: 2})
    (line,) = liger.liger_problems(_args("--use_liger_kernel", flag, "2"), ctx, "cuda", LlamaConfig())
    assert f"{flag} 2" in line and "data parallelism" in line


def test_a_family_without_kernels_is_refused_not_silently_skipped(fake_liger):
    (line,) = liger.liger_problems(_args("--use_liger_kernel"), ONE, "cuda", SimpleNamespace(model_type="gpt2"))
    assert "'gpt2'" in line and "llama" in line
    assert liger.liger_problems(_args("--use_liger_kernel"), ONE, "cuda", LlamaConfig()) == []


def test_applies_the_familys_kernels_and_never_the_loss_kernels(fake_liger):
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))  # fmt: skip
    info = liger.apply_liger(model)
    assert info == {"family": "llama", "kernels": ["rope", "rms_norm", "swiglu"]}  # llama's function has no geglu
    ((got, kw),) = fake_liger
    assert got is model
    assert kw == {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                  "fused_linear_cross_entropy": False}  # fmt: skip


@pytest.mark.slow  # a recipe process: the refusal as a user meets it, before the model loads
def test_recipe_refuses_on_cpu_in_one_line(tmp_path):
    model = _model_dir(tmp_path)  # a config.json only: loading it would fail, so the refusal comes first
    cmd = [sys.executable, str(ROOT / "recipes" / "sft.py"), "--model_name_or_path", model, "--use_liger_kernel",
           "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "--use_liger_kernel" in x]
    assert len(lines) == 1 and "Triton GPU kernels" in lines[0], proc.stderr[-2000:]
