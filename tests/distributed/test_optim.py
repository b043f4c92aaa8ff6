"""hfpar.backends.optim: the AdamW implementation (--optim) changes speed, not results.

    python -m pytest -q tests/distributed/test_optim.py

Fused, foreach and the per-parameter for-loop run the same AdamW math with a different order of float
operations. Measured on the embedded tiny Llama, 10 steps on one batch, lr 1e-2, weight decay 0.1
(max |a - b| / max |b| over each parameter tensor, worst tensor; foreach is bit-equal to the for-loop on CPU):
  - the same gradients replayed in fp32 (the optimizer alone): fused vs for-loop 1.7e-7
  - real training in fp64: 1.2e-14 -- the same math
  - real training in fp32: per-step losses within 1.4e-7; parameters 2.6e-4, because Adam divides each
    gradient element by its own running scale, so step 1's rounding (1e-7) changes step 2's small gradient
    elements by a visible fraction of their size; the same amplification turns fp64's 1e-16 into 1e-14.
Wrong hyperparameters are far outside these tolerances (same gradients, fp32): weight decay 0.09 instead of
0.1: 8.6e-4; beta2 0.998: 5.2e-4; eps 1e-7: 7e-2; L2 instead of decoupled weight decay: 1.2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar import data
from hfpar.backends import optim as O
from hfpar.config import OPTIMIZERS, ConfigError, RecipeArgs, parse_args
from tests.helpers.dist import run_distributed

RTOL_FP32 = 1e-6  # the same gradients, fp32: measured 1.7e-7
RTOL_FP64 = 1e-12  # training, fp64: measured 1.2e-14
RTOL_LOSS_FP32 = 1e-5  # training, fp32, per-step loss: measured 1.4e-7


def _args(optim: str, **kw) -> RecipeArgs:
    return dataclasses.replace(RecipeArgs(), optim=optim, learning_rate=1e-2, weight_decay=0.1, **kw)


def _tiny_llama(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path())).to(dtype)


def _use(impl: str, monkeypatch) -> str:
    """The --optim value that builds `impl` on CPU; foreach is the fallback where fused is unsupported."""
    if impl == "foreach":
        monkeypatch.setattr(O, "fused_supported", lambda params: False)  # as on a device without fused kernels
    return "adamw_torch" if impl == "for-loop" else "adamw_torch_fused"


def _train(optim: str, dtype=torch.float32, replay: list | None = None, steps: int = 10):
    """10 AdamW steps on the tiny Llama with one fixed batch, or with `replay`'s gradients (then no forward).
    Returns (params, optimizer, losses, the gradients of each step)."""
    model = _tiny_llama(dtype)
    opt = O.build_optimizer(model, _args(optim))
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for step in range(steps):
        if replay is None:  # one fixed batch, so the loss falls visibly
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        else:
            for n, p in model.named_parameters():
                p.grad = replay[step][n].clone()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt, losses, grads


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.fixture(scope="module")
def loop_fp32():
    return _train("adamw_torch")


@pytest.fixture(scope="module")
def loop_fp64():
    return _train("adamw_torch", dtype=torch.float64)


def test_default_is_fused_on_cpu():
    assert RecipeArgs().optim == "adamw_torch_fused" and parse_args([]).optim == "adamw_torch_fused"
    assert O.implementation(O.build_optimizer(torch.nn.Linear(3, 3), _args("adamw_torch_fused"))) == "fused"
    # torch's own choice on CPU (HF's adamw_torch): the per-parameter for-loop
    assert O.implementation(O.build_optimizer(torch.nn.Linear(3, 3), _args("adamw_torch"))) == "for-loop"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_same_gradients_same_parameters_fp32(impl, loop_fp32, monkeypatch):
    ref, ref_opt, _, grads = loop_fp32
    params, opt, _, _ = _train(_use(impl, monkeypatch), replay=grads)
    assert O.implementation(ref_opt) == "for-loop" and O.implementation(opt) == impl
    rel = _max_rel(params, ref)
    assert rel < RTOL_FP32, f"{impl} vs for-loop, same gradients, 10 steps: {rel:.2e} relative"
    # the parameters moved far more than the tolerance, so the comparison can fail
    init = {n: p.detach() for n, p in _tiny_llama().named_parameters()}
    assert _max_rel(init, ref) > 1e4 * RTOL_FP32
    # the same weight-decay groups (HF's rule: no decay on 1-D params) and hyperparameters
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    for g, r in zip(opt.param_groups, ref_opt.param_groups, strict=True):
        assert {k: g[k] for k in keys} == {k: r[k] for k in keys}
        assert [p.shape for p in g["params"]] == [p.shape for p in r["params"]]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(ref)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_training_matches_the_for_loop(impl, loop_fp32, loop_fp64, monkeypatch):
    """End to end (gradients from the updated parameters): fp64 to 1e-12, fp32 losses to 1e-5."""
    optim = _use(impl, monkeypatch)
    params, opt, _, _ = _train(optim, dtype=torch.float64)
    assert O.implementation(opt) == impl and next(iter(params.values())).dtype == torch.float64
    assert _max_rel(params, loop_fp64[0]) < RTOL_FP64
    _, _, losses, _ = _train(optim)
    ref_losses = loop_fp32[2]
    assert losses[-1] < 0.9 * losses[0]  # it learns
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)) < RTOL_LOSS_FP32


def test_unsupported_device_falls_back_to_foreach():
    meta = torch.nn.Linear(4, 4, device="meta")
    assert not O.fused_supported(list(meta.parameters())) and O.fused_supported([torch.zeros(2)])
    assert O.implementation(O.build_optimizer(meta, _args("adamw_torch_fused"))) == "foreach"


def test_bad_optim_is_one_line_error():
    with pytest.raises(ConfigError) as e:
        parse_args(["--optim", "adamw_8bit"])
    assert str(e.value) == f"--optim 'adamw_8bit': valid values are {', '.join(OPTIMIZERS)}"
    with pytest.raises(ValueError, match="--optim 'sgd': valid values are adamw_torch_fused, adamw_torch"):
        O.build_optimizer(torch.nn.Linear(2, 2), _args("sgd"))


def _fsdp2_run(mesh, optim: str, shard_all: bool, rank: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5)).double()
    fully_shard(model[0], mesh=mesh)  # 33 rows over 2 ranks: uneven shards
    if shard_all:
        fully_shard(model, mesh=mesh)
    # else: plain tensors next to the DTensors, as EP x FSDP2 leaves the experts (their grads averaged below)
    opt = O.build_optimizer(model, _args(optim))
    g = torch.Generator().manual_seed(rank)
    for _ in range(10):
        model(torch.randn(8, 16, generator=g, dtype=torch.float64)).square().mean().backward()
        if not shard_all:
            for p in model[1:].parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= torch.distributed.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=True)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()
    }
    return O.implementation(opt), full, sorted({type(p).__name__ for p in model.parameters()})


def _fsdp2_fused(rank, world_size):
    """FSDP2 (DTensor params, uneven shards, fp64): fused AdamW runs on the local shards, equal to the for-loop; with
    plain tensors next to the DTensors (EP x FSDP2), neither fused nor foreach takes the mix: the for-loop, which
    trains as the all-DTensor model does (grads averaged over the ranks both ways)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    impl_f, fused, kinds = _fsdp2_run(mesh, "adamw_torch_fused", True, rank)
    impl_l, loop, _ = _fsdp2_run(mesh, "adamw_torch", True, rank)
    impl_m, mixed, mixed_kinds = _fsdp2_run(mesh, "adamw_torch_fused", False, rank)
    return (impl_f, impl_l, impl_m), max(_max_rel(fused, loop), _max_rel(mixed, loop)), kinds, mixed_kinds


def test_fused_on_fsdp2_dtensors():
    for impls, rel, kinds, mixed_kinds in run_distributed(_fsdp2_fused, 2):
        assert impls == ("fused", "for-loop", "for-loop") and rel < RTOL_FP64, (impls, rel)
        assert kinds == ["DTensor"] and mixed_kinds == ["DTensor", "Parameter"]
