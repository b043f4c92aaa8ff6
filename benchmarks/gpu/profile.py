"""Where the sft (or dpo) recipe's step spends its time on one GPU: torch.profiler over a few steps of the recipe.

    python -m benchmarks.gpu.profile --out /tmp/prof [--recipe dpo --steps 12 --profile_from 8 -- <recipe options>]
    bash benchmarks/gpu/busy.sh OUT      # sft and dpo, prefetch off / on, eager and compiled: GPU busy per step

The GPU busy figure is the kernels' own device time over the profiled steps' wall time (run back to back), in
OUT/profile_<tag>.json (step_wall_ms, kernel_ms, busy) and the first line of OUT/profile_<tag>.txt.

The model is benchmarks/gpu/sft.py's (~0.9B Llama-style, random init, saved once so the recipe loads it with
from_pretrained), trained in this process through hfpar.recipe.main with bf16 autocast (what `accelerate launch` with
single.yaml sets). Steps profile_from .. profile_from+3 are recorded; each phase of hfpar's step is a named range
(batch, forward+loss, backward, clip, optimizer, zero_grad), so GPU time is split between the phases and hfpar's share
(batch building, loss, clip, optimizer) is visible next to the model's own. Writes OUT/profile_<tag>.txt (the
phase table and the top kernels by GPU time) and prints them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common.launch import ROOT
from benchmarks.gpu.sft import build_model
from hfpar.backends import base as B
from hfpar.recipe import main as recipe_main
from hfpar.train import trainer as T

PHASES = {"forward_loss": "forward+loss", "clip": "clip", "step": "optimizer", "zero_grad": "zero_grad"}


def _ranged(fn, name):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(f"hfpar::{name}"):
            return fn(*a, **k)

    return wrapper


def instrument(prof_box: dict, start: int, n: int) -> None:
    for meth, name in PHASES.items():
        for cls in [B.Backend, *B.Backend.__subclasses__()]:
            if meth in vars(cls):
                setattr(cls, meth, _ranged(vars(cls)[meth], name))
    orig_backward = B.Backend.train_micro

    def train_micro(self, batch, scope, loss_fn, scale, task="lm"):
        orig = self.acc.backward

        def backward(loss, **kw):
            with record_function("hfpar::backward"):
                return orig(loss, **kw)

        self.acc.backward = backward
        try:
            return orig_backward(self, batch, scope, loss_fn, scale, task)
        finally:
            self.acc.backward = orig

    B.Backend.train_micro = train_micro
    # a step's batches: read, collated, counted and copied in the prefetch thread (or in the step with
    # --dataloader_prefetch_factor 0): its host time shows on that thread's timeline
    T.Trainer._load_step = _ranged(T.Trainer._load_step, "load_step")
    orig_step = T.Trainer._train_step

    def train_step(self, step, *rest):
        if step == start:
            _sync()
            acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
            prof_box["prof"] = profile(activities=acts, record_shapes=False)
            prof_box["prof"].__enter__()
            prof_box["t0"] = time.perf_counter()
        with record_function("hfpar::train_step"):
            rec = orig_step(self, step, *rest)
        if step == start + n - 1:
            _sync()
            prof_box["wall_s"] = time.perf_counter() - prof_box["t0"]  # the profiled steps back to back, end to end
            prof_box["prof"].__exit__(None, None, None)
        return rec

    T.Trainer._train_step = train_step


def _sync() -> None:
    if torch.cuda.is_available():  # the code path runs on CPU too (benchmarks/gpu/round.sh with HFPAR_ROUND_CPU=1)
        torch.cuda.synchronize()


def _annotation(e) -> bool:
    return getattr(e, "is_user_annotation", False) or e.key.startswith(("hfpar::", "Optimizer.", "ProfilerStep"))


def busy(prof, n: int, wall_s: float) -> dict:
    """GPU busy: the kernels' (and copies') own device time per step against the step's wall time."""
    # torch 2.11 reports record_function ranges (hfpar::*, Optimizer.step#...) as GPU events too: not kernels
    kernel_us = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not _annotation(e)
    )
    wall_ms, kernel_ms = wall_s * 1e3 / n, kernel_us / 1e3 / n
    return {"step_wall_ms": round(wall_ms, 2), "kernel_ms": round(kernel_ms, 2), "busy": round(kernel_ms / wall_ms, 4)}


def report(prof, n: int, wall_s: float) -> str:
    ev = prof.key_averages()
    dev = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    rows = sorted((e for e in ev if e.key.startswith("hfpar::")), key=dev, reverse=True)
    b = busy(prof, n, wall_s)
    lines = [
        f"step wall {b['step_wall_ms']:.2f} ms, kernels {b['kernel_ms']:.2f} ms: GPU busy {100 * b['busy']:.1f}%",
        "",
        f"phases, per step (mean over {n} steps): GPU ms of the kernels launched inside / CPU ms",
        "",
    ]
    for e in rows:
        lines.append(f"{e.key:28s} gpu {dev(e) / 1e3 / n:9.2f} ms   cpu {e.cpu_time_total / 1e3 / n:9.2f} ms")
    kernels = sorted(
        (e for e in ev if dev(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA), key=dev, reverse=True
    )
    total = sum(dev(e) for e in kernels)
    lines += ["", f"top GPU kernels (total {total / 1e3 / n:.1f} ms/step)", ""]
    for e in kernels[:40]:
        lines.append(f"{dev(e) / 1e3 / n:8.2f} ms/step {100 * dev(e) / total:5.1f}%  x{e.count // n:<5d} {e.key[:110]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="eager")
    p.add_argument("--recipe", default="sft", choices=("sft", "dpo"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile_from", type=int, default=8)
    p.add_argument("--profile_steps", type=int, default=3)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048, help="the Llama's width (MLP 2.75x, heads of 128)")
    p.add_argument("--layers", type=int, default=16)
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="hfpar-prof-model-"))
    heads = max(1, args.hidden // 128)
    ns = argparse.Namespace(
        hidden=args.hidden,
        intermediate=args.hidden * 11 // 4,
        layers=args.layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
    )
    build_model(model_dir, ns)
    os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "bf16")
    box: dict = {}
    instrument(box, args.profile_from, args.profile_steps)
    argv = [
        "--model_name_or_path",
        str(model_dir),
        "--tokenizer_name_or_path",
        str(ROOT / "hfpar" / "assets" / "tiny"),
        # sft: packed rows of seq_len tokens; dpo: each pair one row (the recipe's own packing), at most seq_len
        *(["--packing", "--max_seq_length"] if args.recipe == "sft" else ["--max_length"]),
        str(args.seq_len),
        "--per_device_train_batch_size",
        str(args.batch_size),
        "--max_steps",
        str(args.steps),
        "--eval_steps",
        "0",
        "--logging_steps",
        "4",
        "--save_final_model",
        "false",
        "--output_dir",
        tempfile.mkdtemp(prefix="hfpar-prof-run-"),
        *extra,
    ]
    recipe_main(args.recipe, argv)
    text = report(box["prof"], args.profile_steps, box["wall_s"])
    (out / f"profile_{args.tag}.txt").write_text(f"options: {' '.join(extra)}\n\n{text}\n")
    summary = {"recipe": args.recipe, "options": extra, **busy(box["prof"], args.profile_steps, box["wall_s"])}
    (out / f"profile_{args.tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
