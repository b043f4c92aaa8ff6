"""Mixed precision of the model-parallel backends, in process on 2 gloo ranks: fp16 loss scaling
(hfpar/backends/loss_scale.py) and the accelerate config's FSDP2 settings in hfpar's FSDP2 wrap for TP / EP.

    python -m pytest -q -p no:cacheprovider tests/launch/test_mixed_precision.py

Accelerate builds no GradScaler and no fp16 autocast on CPU (a launch with --mixed_precision fp16 is refused
there), so the backends' clip / step are driven here with torch's CPU GradScaler standing in for the one
Accelerate builds on a GPU: grads scaled as acc.backward leaves them, then backend.clip / overflowed / step as the
trainer calls them. TP over DDP (a TP-sharded weight and a replicated bias), FSDP2 (DTensor grads) and PP=2
(1F1B: the schedule's own backward). The trainer's side (an overflow is not a non-finite step) with a stub backend.
Here an overflow on one rank only; real fp16 launches end to end: tests/launch/test_fp16_parity.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig

from hfpar import preflight as pf
from hfpar.backends import ModelParallelDDP, ModelParallelDeepSpeed, ModelParallelFSDP2, PipelineDDP
from hfpar.backends.wraps import fsdp2_settings
from hfpar.config import ConfigError, parse_args
from hfpar.context import ParallelContext
from hfpar.objectives.base import Objective
from hfpar.parallel.context_parallel import shift_labels
from hfpar.parallel.expert_parallel.router import AuxLossBackprop, set_aux_loss_grad_scale, set_aux_loss_loss_scale
from hfpar.parallel.pipeline import PipelineStage, balanced_split
from hfpar.parallel.sharding import set_shard_spec
from hfpar.train.losses import shifted_lm_loss_sum
from hfpar.train.trainer import Trainer
from tests.helpers.dist import run_distributed

SCALE = 1024.0


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))


def _args():  # hfpar's default AdamW: fused where the device has it (the scaler passes it the overflow flag)
    return parse_args(["--learning_rate", "0.01"], recipe="sft")


def _g(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _clip_and_step(backend, max_norm: float, out: dict) -> float:
    """What the trainer does after the backwards: clip (unscaling first), ask whether the world overflowed, step
    (skipped on overflow) and record the norm, the overflow flag and the scale after the step."""
    norm = backend.clip(max_norm)
    out["overflow"].append(backend.overflowed(norm))
    backend.step(0.01)
    backend.zero_grad()
    out["scales"].append(backend.scaler.get_scale())
    out["norms"].append(norm)
    return norm


def _tp_over_ddp(rank: int) -> dict:
    """weight: this rank's TP shard (rows); bias: replicated. Step 2 overflows in rank 1's bias only: rank 0's
    grads and even its grad norm stay finite (a replicated grad is counted locally), yet it must skip too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(_g(10 + rank, 3, 4))
    set_shard_spec(model.weight, kind="tp", group=dist.group.WORLD, dim=0, size=2)
    ref = copy.deepcopy(model)
    acc = _accelerator()
    backend = ModelParallelDDP(acc, SimpleNamespace(grad_replicas=1), "ddp", _args())
    backend.prepare(model)
    assert backend.scaler is acc.scaler  # Accelerate's, which acc.backward scales by and save_state checkpoints
    assert backend.optimizer.defaults["fused"]  # the scaler hands a fused step its overflow flag (a scalar)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    g_w, g_b = _g(20 + rank, 3, 4), _g(30, 3)  # the unscaled grads; the bias's is the same on every rank
    true_norm = math.sqrt(
        sum(_g(20 + r, 3, 4).double().square().sum().item() for r in range(2)) + g_b.double().square().sum().item()
    )
    max_norm = 0.5 * true_norm  # clipping active
    out = {"norms": [], "scales": [], "overflow": []}
    for step, overflow_rank in enumerate((None, 1, None)):
        loss = (model.weight * g_w).sum() + (model.bias * g_b).sum()  # d loss / d params = (g_w, g_b)
        acc.scaler.scale(loss).backward()  # as acc.backward(loss) does under fp16
        if rank == overflow_rank:
            model.bias.grad[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        norm = _clip_and_step(backend, max_norm, out)
        if overflow_rank is None:
            assert abs(norm - true_norm) <= 1e-6 * true_norm, (step, norm, true_norm)  # the unscaled norm
            coef = max_norm / (true_norm + 1e-6)
            ref.weight.grad, ref.bias.grad = g_w * coef, g_b * coef
            ref_opt.step()
            for p, r in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
        else:
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "an overflowed step stepped"
    return out


def _fsdp2(rank: int) -> dict:
    """Grads are DTensors (dp-sharded); step 2 puts an inf into rank 1's local shard of the first weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2,))
    acc = _accelerator()
    backend = ModelParallelFSDP2(acc, SimpleNamespace(dp_mesh=lambda _t: mesh), "fsdp2", _args())
    backend.prepare(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    x = _g(40, 6, 4)  # the same rows on both ranks: FSDP2's dp mean is the one-process grad
    out = {"norms": [], "scales": [], "overflow": []}
    for step, overflow_rank in enumerate((None, 1, None)):
        acc.scaler.scale(model(x).square().mean()).backward()
        if rank == overflow_rank:
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")
        before = [p.full_tensor().clone() for p in model.parameters()]
        norm = _clip_and_step(backend, float("inf"), out)
        if overflow_rank is None:
            ref(x).square().mean().backward()
            true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
            ref_opt.step()
            ref_opt.zero_grad()
            assert abs(norm - true_norm) <= 1e-5 * true_norm, (step, norm, true_norm)
            for p, r in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
        else:
            assert all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
    return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Tiny(nn.Module):
    _no_split_modules = ["Block"]  # one FSDP unit per Block, as for an HF decoder layer

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def _fsdp2_settings(mixed_precision: str, reshard: bool) -> dict:
    """hfpar's FSDP2 wrap under a plugin built as Accelerate builds it from an fsdp2 config: the dtype each layer
    computes with (its gathered weight, seen by a forward pre-hook), whether it was resharded after forward."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=reshard)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what AcceleratorState does with the launch's mixed_precision
    acc = SimpleNamespace(device=torch.device("cpu"), scaler=None, state=SimpleNamespace(fsdp_plugin=plugin))
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Tiny()
    backend = ModelParallelFSDP2(acc, SimpleNamespace(dp_mesh=lambda _t: mesh), "fsdp2", _args())
    backend.prepare(model)
    seen = []
    model.blocks[0].proj.register_forward_pre_hook(lambda m, _x: seen.append(m.weight.dtype))
    loss = model(_g(50, 3, 4)).float().square().mean()
    resharded = isinstance(model.blocks[0].proj.weight, DTensor)
    loss.backward()
    return {
        "gathered": seen,
        "resharded_after_forward": resharded,
        "masters": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def _pipeline(rank: int) -> dict:
    """pp=2 (1F1B): the schedule runs its own backwards, so the loss scale rides in its back-propagated factor.
    Clean steps: every stage's grads and the logged norm equal the unsplit fp32 model's (unscaled); step 2: an
    overflow in rank 1's stage only, skipped by both stages."""
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = copy.deepcopy(ref)
    stage = PipelineStage(model, rank, balanced_split(model, 2))
    ctx = SimpleNamespace(
        grad_replicas=1, rank=rank, pp_peers=[0, 1], pp_group=dist.group.WORLD, rank_lists=lambda *_axes: [[0, 1]]
    )
    acc = _accelerator()
    acc.autocast = contextlib.nullcontext  # fp32 compute: what is under test is the scale, not fp16 rounding
    args = parse_args(["--pp_size", "2", "--pp_schedule", "1f1b", "--pp_microbatches", "2"], recipe="sft")
    plan = SimpleNamespace(microbatches=2, image_text=False)
    backend = PipelineDDP(acc, ctx, "ddp", args, run_plan=plan)  # the RunPlan's fields the backend reads
    backend.prepare(stage)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))
    batch = shift_labels({"input_ids": ids, "labels": ids.clone()})
    out = {"norms": [], "scales": [], "overflow": []}
    for step, overflow_rank in enumerate((None, 1)):
        backend.train_micro(batch, contextlib.nullcontext(), shifted_lm_loss_sum, 0.1)
        if rank == overflow_rank:
            next(p for p in stage.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        if overflow_rank is None:
            ref.zero_grad()
            (shifted_lm_loss_sum(ref(input_ids=batch["input_ids"]).logits, batch["labels"])[0] * 0.1).backward()
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        norm = backend.clip(float("inf"))
        out["overflow"].append(backend.overflowed(norm))
        if overflow_rank is None:
            true_norm = float(torch.nn.utils.get_total_norm(list(ref_grads.values())))
            assert abs(norm - true_norm) <= 1e-5 * true_norm, (norm, true_norm)
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[stage.hf_name(name)], rtol=1e-4, atol=1e-6)
        before = [p.detach().clone() for p in stage.parameters()]
        backend.step(0.01)
        backend.zero_grad()
        out["scales"].append(acc.scaler.get_scale())
        out["norms"].append(norm)
        if overflow_rank is not None:
            assert all(torch.equal(b, p) for b, p in zip(before, stage.parameters())), "an overflowed step stepped"
    return out


def _worker(rank: int, world: int) -> dict:
    return {
        "tp_ddp": _tp_over_ddp(rank),
        "fsdp2": _fsdp2(rank),
        "pipeline": _pipeline(rank),
        "bf16_reshard": _fsdp2_settings("bf16", True),
        "fp32_keep": _fsdp2_settings("no", False),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, 2, timeout=180)


@pytest.mark.parametrize("case", ["tp_ddp", "fsdp2", "pipeline"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, case):
    r0, r1 = (r[case] for r in ranks)
    steps = 2 if case == "pipeline" else 3
    # step 2 overflowed on rank 1 only: both ranks report it and skip (asserted in the worker: params unchanged)
    assert r0["overflow"] == r1["overflow"] == [False, True, False][:steps]
    # the scale halves on every rank (backoff 0.5) and stays equal across ranks
    assert r0["scales"] == r1["scales"] == [SCALE, SCALE / 2, SCALE / 2][:steps]
    # clean steps log the unscaled norm (checked against the fp32 reference in the worker), equal on both ranks
    for step in (0, 2)[: steps - 1]:
        assert r0["norms"][step] == pytest.approx(r1["norms"][step], rel=1e-12)
    if case == "tp_ddp":  # the same grads at scale 1024 and at 512: the same logged norm
        assert r0["norms"][2] == pytest.approx(r0["norms"][0], rel=1e-12)


def test_fsdp2_wrap_for_tp_ep_uses_the_configs_mixed_precision_and_reshard(ranks):
    """bf16 config: the layers compute with bf16 gathered weights (all-gathered in bf16), the sharded masters and
    their grads stay fp32; no mixed precision: fp32 gathers. reshard_after_forward: false keeps the gathered
    weights after forward, true frees them (the layer's parameter is the sharded DTensor again)."""
    for r in ranks:
        bf16, fp32 = r["bf16_reshard"], r["fp32_keep"]
        assert bf16["gathered"] == [torch.bfloat16] and fp32["gathered"] == [torch.float32]
        for run in (bf16, fp32):
            assert run["masters"] == run["grads"] == ["torch.float32"] and run["sharded"]
        assert bf16["resharded_after_forward"] and not fp32["resharded_after_forward"]


def test_fsdp2_settings_are_accelerates_objects():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False, cpu_offload=True)
    plugin.set_mixed_precision("bf16")
    got = fsdp2_settings(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    assert got["mp_policy"] is plugin.mixed_precision_policy and got["offload_policy"] is plugin.cpu_offload
    assert got["reshard_after_forward"] is False and got["mp_policy"].param_dtype == torch.bfloat16


def test_aux_loss_gradient_scaled_with_the_loss():
    """The MoE aux-loss gradient is injected in backward: under fp16 it must carry the loss scale too."""
    w = torch.tensor(3.0, requires_grad=True)
    x = torch.ones(2, requires_grad=True)
    set_aux_loss_grad_scale(0.5)
    set_aux_loss_loss_scale(SCALE)
    try:
        AuxLossBackprop.apply(x, w * w).sum().backward()
    finally:
        set_aux_loss_grad_scale(1.0)
        set_aux_loss_loss_scale(1.0)
    assert w.grad.item() == pytest.approx(2 * 3.0 * 0.5 * SCALE)


def test_fp16_refusals_are_one_line():
    args = parse_args([], recipe="sft")
    cpu_acc = SimpleNamespace(
        distributed_type=DistributedType.MULTI_CPU,
        num_processes=2,
        process_index=0,
        mixed_precision="fp16",
        device=torch.device("cpu"),
        is_fsdp2=False,
    )
    with pytest.raises(ConfigError) as err:
        pf.preflight(args, cpu_acc, "lm")
    assert str(err.value) == (
        "--mixed_precision fp16 on CPU: Accelerate runs no fp16 autocast and no loss scaling "
        "there (the run would silently be fp32); use --mixed_precision bf16 or no"
    )
    lines = ModelParallelDeepSpeed.check(args, ParallelContext.plan(2, tp=2), "zero2", "fp16")
    assert lines == [
        "--tp_size 2 with zero2 and fp16: DeepSpeed's fp16 loss scaling is not verified with hfpar's "
        "model parallelism; use bf16 (or ddp.yaml / fsdp2.yaml, where hfpar unscales fp16 itself)"
    ]
    assert ModelParallelDeepSpeed.check(args, ParallelContext.plan(2, tp=2), "zero2", "bf16") == []
    assert ModelParallelFSDP2.check(args, ParallelContext.plan(2, ep=2), "fsdp2", "fp16") == [
        "--ep_size 2 with fsdp2 and fp16: the GradScaler cannot unscale the experts' grads together with FSDP2's "
        "sharded ones; use bf16 (or ddp.yaml with fp16)"
    ]
    assert ModelParallelFSDP2.check(args, ParallelContext.plan(2, ep=2), "fsdp2", "bf16") == []


def test_fsdp2_offload_with_model_parallelism_refused(monkeypatch):
    args = parse_args([], recipe="sft")
    assert ModelParallelFSDP2.check(args, ParallelContext.plan(2, tp=2), "fsdp2", "bf16") == []
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")  # what accelerate launch sets for fsdp_offload_params: true
    lines = ModelParallelFSDP2.check(args, ParallelContext.plan(4, tp=2, ep=2), "fsdp2", "bf16")
    assert len(lines) == 1 and lines[0].startswith("fsdp_offload_params: true with --tp_size 2 and --ep_size 2: ")


class _OverflowingBackend:
    """What the trainer sees of a model-parallel backend under fp16 when a step's grads overflow somewhere."""

    steps_in_backward = False

    def __init__(self, overflow: bool):
        self.overflow, self.calls = overflow, []

    def loss_scale(self) -> float:
        return SCALE

    def train_micro(self, batch, scope, loss_fn, scale, task):
        return torch.tensor(2.0)

    def clip(self, max_norm: float) -> float:
        return float("inf") if self.overflow else 1.5

    def overflowed(self, grad_norm: float) -> bool:
        return self.overflow

    def step(self, lr: float) -> None:  # the scaler's step: it skips the update itself, and lowers its scale
        self.calls.append("step")

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")


@pytest.mark.parametrize("overflow", [False, True])
def test_trainer_hands_an_overflowed_step_to_the_scaler(overflow):
    """An fp16 overflow is not a non-finite step (--on_nonfinite error would stop the run): the trainer still
    calls the backend's step (whose scaler skips and backs off) and records the step as skipped, with its scale."""
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}]
    trainer = SimpleNamespace(
        args=SimpleNamespace(max_grad_norm=1.0, on_nonfinite="error", torch_compile=False),
        acc=SimpleNamespace(device=torch.device("cpu")),
        ctx=SimpleNamespace(cp=1, data_replicas=1, grad_replicas=1),
        comm=None,
        train_ds=rows,
        task="lm",
        collator=lambda f: {
            "input_ids": torch.tensor([x["input_ids"] for x in f]),
            "labels": torch.tensor([x["input_ids"] for x in f]),
        },
        batch_plan=lambda b: (b, contextlib.nullcontext()),
        _to_device=lambda b: b,
        objective=Objective(lambda out, labels: None),  # the default hooks (count: target tokens); the backend's fake
        backend=_OverflowingBackend(overflow),
        sampler=SimpleNamespace(steps_per_epoch=10),
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.01], step=lambda: None),
        _copy_stream=None,
        _count_device=torch.device("cpu"),
    )
    loaded = Trainer._load_step(trainer, 0, [[0, 1]])
    rec = Trainer._train_step(trainer, 0, loaded, time.perf_counter(), time.process_time())
    assert trainer.backend.calls == ["step", "zero_grad"]
    assert rec.get("skipped", False) is overflow and rec["loss_scale"] == SCALE
