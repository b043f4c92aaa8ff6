"""The preflight: every problem knowable without weights, collected and reported once, before the model loads.

In process (the preflight's functions with a ParallelContext of any world size) and one subprocess that times
a whole refusal the way a user meets it (`python recipes/sft.py ...`: exit 2 before the layers are imported).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from transformers import AutoConfig, GPT2Config

from hfpar import preflight as pf
from hfpar.backends import STRATEGY, AccelerateBackend, ModelParallelDDP
from hfpar.checkpoint.layout import MARKER, STATE_FILE, run_identity
from hfpar.checkpoint.manifest import write_manifest
from hfpar.checkpoint.output_dir import check_output_dir
from hfpar.config import ConfigError
from hfpar.context import ParallelContext
from tests.helpers.launch import ROOT, env
from tests.helpers.preflight import _args, _model_dir


def test_model_config_problems_are_all_reported(tmp_path):
    model = _model_dir(tmp_path)
    args = _args("--model_name_or_path", model, "--tp_size", "4", "--ep_size", "2")
    lines = pf.model_problems(args, ParallelContext.plan(8, tp=4, ep=2), "lm")
    text = "\n".join(lines)
    assert "num_attention_heads 6 is not divisible" in text and "num_key_value_heads 2 is not divisible" in text
    assert "--ep_size 2: llama has no MoE layers; pass --upcycle_experts" in text  # config without architectures
    assert len(lines) >= 3, lines


def test_upcycling_and_plans_checked_from_the_config(tmp_path):
    model = _model_dir(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    args = _args("--model_name_or_path", model, "--upcycle_experts", "3", "--ep_size", "2")
    assert any(
        "--upcycle_experts 3 is not divisible by --ep_size 2" in x
        for x in pf.model_problems(args, ParallelContext.plan(2, ep=2), "lm")
    )
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64).save_pretrained(gpt2)
    args = _args("--model_name_or_path", str(gpt2), "--tp_size", "2", "--upcycle_experts", "2")
    text = "\n".join(pf.model_problems(args, ParallelContext.plan(2, tp=2), "lm"))
    assert "tensor-parallel" not in text and "'gpt2' cannot be upcycled" in text  # gpt2: a written TP plan
    for model_type, needle in [
        ("inkling_text", None),  # HF's all_reduce entry mapped (the region already sums)
        ("granite_swa", None),  # attention sinks split by head, local_params mapped
        ("opt", None),  # no base_model_tp_plan: inferred from its modules at apply time
        ("olmo2", None),
    ]:  # colwise_gather_output: head-spanning norms sharded (norms.py)
        path = tmp_path / model_type
        AutoConfig.for_model(model_type).save_pretrained(path)
        lines = [
            x
            for x in pf.model_problems(
                _args("--model_name_or_path", str(path), "--tp_size", "2"), ParallelContext.plan(2, tp=2), "lm"
            )
            if x.startswith("--tp_size 2")
        ]
        if needle is None:
            assert not lines, lines
        else:
            assert len(lines) == 1 and needle in lines[0] and "pass plan=" not in lines[0], lines
    granite = tmp_path / "granite"
    AutoConfig.for_model("granite").save_pretrained(granite)  # a plan derived from its base_model_tp_plan
    args = _args("--model_name_or_path", str(granite), "--tp_size", "2", "--sequence_parallel")
    lines = pf.model_problems(args, ParallelContext.plan(2, tp=2, sequence_parallel=True), "lm")
    assert not [x for x in lines if "sequence_parallel" in x], lines  # SP entries from the structure, verified
    assert not [
        x
        for x in pf.model_problems(
            _args("--model_name_or_path", str(granite), "--tp_size", "2"), ParallelContext.plan(2, tp=2), "lm"
        )
        if x.startswith("--tp_size")
    ]
    args = _args("--tp_size", "2", "--sequence_parallel", "--upcycle_experts", "4", "--ep_size", "2")
    ctx = ParallelContext.plan(4, tp=2, ep=2, sequence_parallel=True)
    assert any(
        "--sequence_parallel with --upcycle_experts 4: the MoE blocks stay whole" in x
        for x in pf.feature_problems(args, ctx, "lm")
    )
    assert not pf.feature_problems(
        _args("--tp_size", "2", "--upcycle_experts", "4", "--ep_size", "2"), ParallelContext.plan(4, tp=2, ep=2), "lm"
    )  # EP x TP itself is fine
    args = _args("--model_name_or_path", str(tmp_path / "nowhere"))
    assert "cannot read its config.json" in pf.model_problems(args, ParallelContext.plan(1), "lm")[0]


def _checkpoint(out, **state):
    d = out / "checkpoint-4"
    d.mkdir(parents=True)
    base = {
        "global_step": 4,
        "world_size": 2,
        "dp": 2,
        "tp": 1,
        "ep": 1,
        "strategy": "ddp",
        "seed": 42,
        "global_batch": 8,
    }
    (d / STATE_FILE).write_text(json.dumps({**base, **state}))
    write_manifest(d)
    (d / MARKER).write_text("4")
    return d


_NO_FULL_FORM = "records no full form to reshard from; resume on the checkpoint's mesh"
_MESH_CHANGES = [  # (trainer state, this run's sizes, strategy, backend): another mesh than the checkpoint's
    (dict(tp=2, dp=1), dict(world=2), "ddp", AccelerateBackend),  # tp 2 -> tp 1
    (dict(strategy="zero2"), dict(world=1), "zero2", AccelerateBackend),  # ZeRO-2 @ 2 -> @ 1
    (dict(strategy="zero2"), dict(world=2), "ddp", AccelerateBackend),  # ZeRO-2 -> DDP
    (dict(ep=2, world_size=4, dp=4), dict(world=2, ep=2), "ddp", ModelParallelDDP),  # ep 2 x dp 4 -> x dp 2
]


@pytest.mark.parametrize(
    "state, ctx, strategy, backend, expected",
    [
        *[(*case, _NO_FULL_FORM) for case in _MESH_CHANGES],  # written without a full form (an older hfpar)
        (
            dict(global_batch=16),
            dict(world=2),
            "ddp",
            AccelerateBackend,
            "trained with global batch 16, this run has 8",
        ),
    ],
)
def test_incompatible_resumes_refused_from_trainer_state(tmp_path, state, ctx, strategy, backend, expected):
    out = tmp_path / "out"
    _checkpoint(out, **state)
    ctx = dict(ctx)  # the parameters are shared with the test below
    c = ParallelContext.plan(ctx.pop("world"), strategy=STRATEGY[strategy], **ctx)
    per_device = 8 // (c.dp * 2)
    args = _args(
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        str(per_device),
        *(["--ep_size", "2"] if c.ep > 1 else []),
    )
    lines = pf.resume_problems(args, c, backend)
    assert any(expected in x for x in lines), lines
    assert all("\n" not in x for x in lines)


@pytest.mark.parametrize("state, ctx, strategy, backend", _MESH_CHANGES)
def test_mesh_changes_with_a_full_form_are_accepted(tmp_path, state, ctx, strategy, backend):
    """The same changes, written by this hfpar (trainer_state.json says "reshardable"): resharded at resume."""
    out = tmp_path / "out"
    _checkpoint(out, **state, reshardable=True)
    ctx = dict(ctx)
    c = ParallelContext.plan(ctx.pop("world"), strategy=STRATEGY[strategy], **ctx)
    args = _args(
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        str(8 // (c.dp * 2)),
        *(["--ep_size", "2"] if c.ep > 1 else []),
    )
    assert pf.resume_problems(args, c, backend) == []


def test_compatible_resume_is_accepted(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, world_size=2)
    args = _args(
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        "1",
    )
    assert (
        pf.resume_problems(args, ParallelContext.plan(4, strategy=STRATEGY["ddp"]), AccelerateBackend) == []
    )  # DDP: other world ok


def test_another_runs_checkpoint_or_a_finished_run_is_refused(tmp_path):
    """The issue's case, in process: a finished 16-step run's dir. `latest` with --max_steps 8 refuses its
    checkpoint-16 (past it), one of another seed too (unless its path is passed); with no checkpoint left, its final
    model and metrics are not replaced without --overwrite_output_dir (launched end to end: test_reliability)."""
    out = tmp_path / "out"
    run = [
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
    ]
    ckpt = _checkpoint(out, global_step=16, identity=run_identity(_args(*run)))
    ctx = ParallelContext.plan(2, strategy=STRATEGY["ddp"])
    assert pf.resume_problems(_args(*run), ctx, AccelerateBackend) == []
    [line] = pf.resume_problems(_args(*run, "--max_steps", "8"), ctx, AccelerateBackend)
    assert line.startswith(
        f"checkpoint {ckpt} is at step 16, past this run's --max_steps 8: it belongs to a longer run"
    )
    [line] = pf.resume_problems(_args(*run, "--seed", "7"), ctx, AccelerateBackend)
    assert f"checkpoint {ckpt} belongs to another run (seed 42; this run: seed 7)" in line
    explicit = [*run[:2], "--resume_from_checkpoint", str(ckpt), *run[4:], "--seed", "7", "--max_steps", "8"]
    assert pf.resume_problems(_args(*explicit), ctx, AccelerateBackend) == []  # its path, passed explicitly
    shutil.rmtree(ckpt)
    for name in ("model.safetensors", "metrics.jsonl"):
        (out / name).write_text("a finished run's")
    with pytest.raises(
        ConfigError,
        match="holds a previous run .*metrics.jsonl, model.safetensors.* pass --overwrite_output_dir to replace it",
    ):
        check_output_dir(_args(*run))
    args = _args(*run, "--overwrite_output_dir")
    check_output_dir(args)
    assert args.resume_from_checkpoint is None  # `latest` after an overwrite: a fresh start, never the old run


# what the preflight must not import: transformers' modeling code (with torchao where installed), torch._dynamo,
# PEFT, DeepSpeed (~3 s per process together); imported by the run after the preflight (hfpar.lazy_exports)
_RUN_ONLY = (
    "transformers.modeling_utils",
    "torchao",
    "torch._dynamo",
    "peft",
    "deepspeed",
    "transformers.masking_utils",
)
_WATCH = (
    "import atexit, runpy, sys; sys.argv = sys.argv[1:]; "
    "atexit.register(lambda: print('IMPORTED', sorted(m for m in {mods!r} if m in sys.modules), file=sys.stderr)); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _timed(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    return proc, time.perf_counter() - t0


@pytest.mark.serial
def test_a_refusal_imports_no_layers(tmp_path):
    """Several problems at once (sequence parallelism with MoE blocks; tp 2 does not fit one process), each on its own
    line, exit 2, before the parallel layers and transformers' modeling code are imported: the whole process within
    1.8x a process that imports only what any run needs first (torch, Accelerate's Accelerator, AutoConfig), timed
    beside it (a wall-clock bound of its own was 8 s here and 13.7 s on CI's machine for the same tree)."""
    floor, t_floor = _timed(
        [sys.executable, "-c", "import torch; from accelerate import Accelerator; from transformers import AutoConfig"]
    )
    assert floor.returncode == 0, floor.stderr[-2000:]
    argv = ["--tp_size", "2", "--sequence_parallel", "--upcycle_experts", "4", "--output_dir", str(tmp_path / "o")]
    proc, dt = _timed([sys.executable, "-c", _WATCH.format(mods=_RUN_ONLY), str(ROOT / "recipes" / "sft.py"), *argv])
    print(f"PREFLIGHT refusal, whole process: {dt:.1f} s; importing torch + Accelerator + AutoConfig: {t_floor:.1f} s")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hfpar: error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert any("--tp_size 2 does not divide the world size 1" in x for x in lines), lines
    assert any("--sequence_parallel with --upcycle_experts 4" in x for x in lines), lines
    assert "IMPORTED []" in proc.stderr, [x for x in proc.stderr.splitlines() if x.startswith("IMPORTED")]
    assert dt < 1.8 * t_floor, (dt, t_floor)


def test_resume_refused_across_pipeline_chunk_layouts(tmp_path):
    """A pipeline rank's state holds its chunks' layers: 2 chunks (interleaved_1f1b) resume natively as 2, as 1 (1f1b)
    only through the full form."""
    out = tmp_path / "out"
    _checkpoint(out, pp=2, dp=1, pp_virtual_stages=2)
    ctx = ParallelContext.plan(2, pp=2, strategy=STRATEGY["ddp"])
    common = (
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "latest",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--pp_size",
        "2",
    )
    lines = pf.resume_problems(_args(*common), ctx, ModelParallelDDP)
    assert any(_NO_FULL_FORM in x for x in lines), lines  # an older checkpoint: no full form to regroup the layers
    assert pf.resume_problems(_args(*common, "--pp_schedule", "interleaved_1f1b"), ctx, ModelParallelDDP) == []


def test_fp16_refused_where_no_loss_scaling_would_happen():
    """The condition is "no loss scaling would happen", not the device: DeepSpeed scales itself (its CPU accelerator
    runs fp16), an enabled GradScaler scales (tests/helpers/fp16_cpu builds one on CPU); a disabled one (what a CUDA
    GradScaler is without CUDA) or none (Accelerate on CPU) does not."""
    multi = DistributedType.MULTI_CPU
    assert pf.fp16_loss_scaling(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, scaler=None))
    assert pf.fp16_loss_scaling(SimpleNamespace(distributed_type=multi, scaler=torch.amp.GradScaler("cpu")))
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert not pf.fp16_loss_scaling(SimpleNamespace(distributed_type=multi, scaler=off))
    assert not pf.fp16_loss_scaling(SimpleNamespace(distributed_type=multi, scaler=None))


@pytest.mark.slow  # a whole recipe process (the in-process checks: tests/unit/test_file_checks.py)
def test_damaged_files_refused_before_the_model_loads(tmp_path):
    """Truncated weights and a data file that is not UTF-8 (`python recipes/sft.py`: one line each naming the file,
    the byte offset for the data). Misspelt accelerate-config keys: tests/unit/test_file_checks.py."""
    from safetensors.torch import save_file

    model = _model_dir(tmp_path)
    save_file({"w": torch.ones(32, 32)}, f"{model}/model.safetensors")
    size = (tmp_path / "model" / "model.safetensors").stat().st_size
    with open(f"{model}/model.safetensors", "r+b") as fh:
        fh.truncate(size - 64)
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "sft.py"),
            "--model_name_or_path",
            model,
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
        ],
        check=False,
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hfpar: error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines == [
        f"hfpar: error: {model}/model.safetensors: truncated: {size - 64} bytes, its header says {size}",
        (f"hfpar: error: {data}: not UTF-8 text at byte offset 50 (invalid continuation byte); re-encode it as UTF-8"),
    ], lines
