"""Where a DPO step's time goes: hfpar's recipe and TRL 1.16's DPOTrainer (no gradient checkpointing) under
torch.profiler for a few steps, on the model, pairs and batches of benchmarks/dpo/speed.py. Run by
benchmarks/dpo/speed.py (on CUDA by default, --profile on CPU) in fresh subprocesses; writes DIR/profile_<device>.md
(and .json).

Per profiled step, for each trainer: wall time; device (kernel) time, i.e. how busy the GPU is; kernel launches;
device -> host copies (each a host sync: .item(), .cpu(), nonzero, boolean indexing); the host time spent waiting
in CUDA synchronizations. hfpar's step is also cut into its phases (host time measured around each call, the
GPU not synchronized: a phase's time is the host's work plus any sync it waits in): collation, batch plan,
before_micro (attention mask from the pair layout, the completion targets: one nonzero, the reference forward),
the policy's forward + backward, the step's one reduction + read of loss and metrics, clipping, optimizer step.
The attention check times SDPA forward + backward on one real batch's shapes: the packed shared-prompt rows with
their (B, 1, T, T) boolean mask (the default dispatch: transformers passes no GQA with a mask, so the memory-
efficient kernel, or math where it refuses) against the plain rows (each sequence its own row, TRL's layout)
with the causal flash kernel.

    python -m benchmarks.dpo.profile MODEL DATA OPTS_JSON OUT_DIR      # what benchmarks/dpo/speed.py runs
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.dpo import trl_compare

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
WARM, PROFILED = 3, 3  # steps before the profiler starts, steps profiled
PHASES = (
    "collate",
    "plan (shift labels)",
    "reductions + host reads (counts; loss and metrics)",
    "before_micro (mask, targets, reference forward)",
    "  attention mask from the pair layout",
    "  targets (one nonzero: host sync)",
    "  reference forward",
    "policy forward + backward",
    "clip (grad norm: host read)",
    "optimizer step",
)


def _wrap(obj, name: str, label: str, clock: dict) -> None:
    """obj.name timed (host perf_counter, summed into clock[label]) and labelled in the profile."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.perf_counter()
        with record_function(label):
            out = fn(*a, **k)
        clock[label] = clock.get(label, 0.0) + time.perf_counter() - t0
        return out

    setattr(obj, name, timed)


def _summary(prof, steps: int, wall_s: float) -> dict:
    """Per-step totals of a profile: device time of the kernels, launches, device -> host copies, sync waits."""
    kernel_us = op_us = launches = d2h = h2d = sync_us = 0.0
    sdpa, spans = {}, {}
    for a in prof.key_averages():
        if a.key in PHASES:
            if a.device_type == torch.autograd.DeviceType.CUDA:  # a phase's range mirrored on the GPU timeline
                spans[a.key.strip()] = round(a.device_time_total / 1e3 / steps, 2)
            continue
        if "scaled_dot_product" in a.key and a.key.startswith("aten::_"):
            sdpa[a.key] = sdpa.get(a.key, 0) + a.count // steps
        if a.key in SYNC_CALLS:
            sync_us += a.self_cpu_time_total
        if a.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += a.count
        if a.key.startswith("Memcpy DtoH"):
            d2h += a.count
        if a.key.startswith("Memcpy HtoD"):
            h2d += a.count
        if a.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += a.self_device_time_total  # the kernels (and copies) themselves
        else:
            op_us += a.self_device_time_total  # the same time, attributed to the ops that launched it
    ms = lambda us: round(us / 1e3 / steps, 2)
    return {
        "wall_ms": round(wall_s * 1e3 / steps, 2),
        "device_busy_ms": ms(kernel_us),
        "device_ms_by_ops": ms(op_us),
        "sync_wait_ms": ms(sync_us),
        "kernel_launches": round(launches / steps, 1),
        "device_to_host_copies": round(d2h / steps, 1),
        "host_to_device_copies": round(h2d / steps, 1),
        "sdpa_kernels_per_step": sdpa,
        "phase_device_spans_ms": spans,
    }


def _activities(device: str):
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_hfpar(model: str, data: str, opts: dict, out: Path) -> tuple[dict, str, dict]:
    """hfpar's steps WARM+1..WARM+PROFILED under the profiler, its phases timed; -> (summary, op tables, batch)."""
    from hfpar.data import preference
    from hfpar.objectives import preference as dpo
    from hfpar.train import batch_plan, trainer

    device, clock, state, seen = opts["device"], {}, {}, {}
    _wrap(preference.PairCollator, "__call__", "collate", clock)
    _wrap(batch_plan.BatchPlan, "__call__", "plan (shift labels)", clock)
    _wrap(dpo.DPOObjective, "before_micro", "before_micro (mask, targets, reference forward)", clock)
    _wrap(dpo.DPOObjective, "reference_logps", "  reference forward", clock)
    _wrap(dpo, "Targets", "  targets (one nonzero: host sync)", clock)
    _wrap(preference, "pair_attention_mask", "  attention mask from the pair layout", clock)
    _wrap(trainer, "all_reduce_sum", "reductions + host reads (counts; loss and metrics)", clock)
    step = trainer.Trainer._train_step
    collate = preference.PairCollator.__call__

    def first_batch(self, features):
        batch = collate(self, features)
        seen.setdefault("batch", batch)
        return batch

    preference.PairCollator.__call__ = first_batch

    def stepped(self, i, *rest):
        if "wrapped" not in state:  # the backend's calls: on this trainer's instance
            state["wrapped"] = True
            _wrap(self.backend, "train_micro", "policy forward + backward", clock)
            _wrap(self.backend, "clip", "clip (grad norm: host read)", clock)
            _wrap(self.backend, "step", "optimizer step", clock)
        if i == WARM:
            _sync(device)
            clock.clear()
            state["prof"] = profile(activities=_activities(device))
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        rec = step(self, i, *rest)
        if i == WARM + PROFILED - 1:
            _sync(device)
            state["wall"] = time.perf_counter() - state["t0"]
            state["phases"] = dict(clock)
            state["prof"].__exit__(None, None, None)
        return rec

    trainer.Trainer._train_step = stepped
    trl_compare.run_hfpar(
        model,
        data,
        tempfile.mkdtemp(),
        steps=WARM + PROFILED,
        batch=opts["batch"],
        max_length=opts["max_length"],
        extra=opts.get("hfpar_extra") or None,  # e.g. --torch_compile (benchmarks/dpo/speed.py --hfpar_extra)
    )
    trainer.Trainer._train_step = step
    prof = state["prof"]
    summary = _summary(prof, PROFILED, state["wall"])
    summary["host_phases_ms"] = {
        k: round(state["phases"][k] * 1e3 / PROFILED, 2) for k in PHASES if k in state["phases"]
    }
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(out / "dpo_trace_hfpar.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)  # chrome://tracing or ui.perfetto.dev open it
    return summary, _tables(prof, device), seen["batch"]


def profile_trl(model: str, data: str, opts: dict, out: Path) -> tuple[dict, str]:
    """TRL DPOTrainer (gradient checkpointing off) steps WARM+1..WARM+PROFILED under the profiler."""
    from transformers import TrainerCallback

    device, state = opts["device"], {}

    class Prof(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if st.global_step == WARM:
                _sync(device)
                state["prof"] = profile(activities=_activities(device))
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            if st.global_step == WARM + PROFILED and "prof" in state:
                _sync(device)
                state["wall"] = time.perf_counter() - state["t0"]
                state["prof"].__exit__(None, None, None)

    from trl import DPOTrainer

    init = DPOTrainer.__init__

    def with_callback(self, *a, **k):
        k["callbacks"] = [*(k.get("callbacks") or []), Prof()]
        init(self, *a, **k)

    DPOTrainer.__init__ = with_callback
    trl_compare.run_trl(
        model,
        data,
        tempfile.mkdtemp(),
        steps=WARM + PROFILED,
        batch=opts["batch"],
        max_length=opts["max_length"],
        device=device,
        bf16=opts["dtype"] == "bfloat16",
    )
    DPOTrainer.__init__ = init
    return _summary(state["prof"], PROFILED, state["wall"]), _tables(state["prof"], device)


def _tables(prof, device: str) -> str:
    keys = ["self_cpu_time_total"] + (["self_device_time_total"] if device == "cuda" else [])
    return "\n\n".join(
        f"sorted by {k}:\n" + prof.key_averages().table(sort_by=k, row_limit=25, max_name_column_width=60) for k in keys
    )


def attention_check(batch: dict, config: dict, device: str, dtype: torch.dtype, reps: int = 10) -> dict:
    """SDPA forward + backward (ms) at one real batch's shapes: packed shared-prompt rows under their boolean
    mask (default dispatch, and the memory-efficient kernel forced) vs plain rows (2P rows of each sequence,
    padded to the longest) causal with the flash kernel forced where there is one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hfpar.data.preference import pair_attention_mask

    H, D = config["num_attention_heads"], config["head_dim"]
    B, T = batch["input_ids"].shape
    mask = pair_attention_mask(batch["pair_layout"].to(device)) if "pair_layout" in batch else None
    # the plain layout's rows: each sequence alone, padded to the longest (as TRL pads them)
    P = len(batch["pairs"]) if "pairs" in batch else B
    plain_T = int(batch["position_ids"].max()) + 1

    def timed(rows: int, length: int, attn_mask, backends, causal: bool):
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(rows, H, length, D, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(3)
        )
        try:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                for i in range(reps + 2):
                    if i == 2:
                        _sync(device)
                        t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal).sum().backward()
                _sync(device)
        except RuntimeError as e:
            return f"refused: {str(e).splitlines()[0][:120]}"
        return round((time.perf_counter() - t0) * 1e3 / reps, 3)

    res = {"packed_rows": [B, T], "plain_rows": [2 * P, plain_T], "heads": H, "head_dim": D}
    if mask is not None:
        res["packed_mask_default_ms"] = timed(B, T, mask, None, False)
        res["packed_mask_efficient_ms"] = timed(B, T, mask, [SDPBackend.EFFICIENT_ATTENTION], False)
    res["plain_causal_default_ms"] = timed(2 * P, plain_T, None, None, True)
    res["plain_causal_flash_ms"] = timed(2 * P, plain_T, None, [SDPBackend.FLASH_ATTENTION], True)
    return res


def main() -> None:
    model, data, opts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    if opts["device"] == "cpu":
        torch.set_num_threads(1)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if opts["dtype"] == "bfloat16" else "no"
    if sys.argv[5:] == ["trl"]:
        summary, tables = profile_trl(model, data, opts, out)
        print("RESULT " + json.dumps({"summary": summary, "tables": tables}))
        return
    summary, tables, batch = profile_hfpar(model, data, opts, out)
    dtype = torch.bfloat16 if opts["dtype"] == "bfloat16" else torch.float32
    cfg = json.loads(Path(model, "config.json").read_text())
    summary["attention_check"] = attention_check(batch, cfg, opts["device"], dtype)
    print("RESULT " + json.dumps({"summary": summary, "tables": tables}))


if __name__ == "__main__":
    main()
