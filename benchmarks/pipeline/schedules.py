"""Pipeline parallelism: measured bubble against theory, peak activation memory GPipe vs 1F1B vs interleaved 1F1B,
point-to-point bytes against theory, and tokens/s against DDP on the same processes.

    python -m benchmarks.pipeline.schedules          # writes benchmarks/results/pipeline/schedules_cpu.{json,md,png}

Setup: a Llama-style model (hidden 256, 8 layers, 8 heads / 4 kv heads, fp32) cut into p = 2 and 4 balanced
stages on p gloo ranks (CPU), one optimizer step's forward + backward of m micro-batches of 1 row x 256 tokens, for
m = p, 2p, 4p; the second of two steps is measured (the first warms up).
  bubble      each stage's seconds blocked in receives over the step's seconds (PipelineRunner.wait_s), against
              (p - 1) / (m + p - 1), the idle fraction of both schedules when stages cost the same, and
              (p - 1) / (V (m + p - 1)) for interleaved 1F1B (V = 2 chunks of 8 / 2p layers per rank)
  memory      the peak bytes of saved-for-backward tensors alive at once on each stage (LiveSavedBytes): GPipe keeps
              all m micro-batches' activations, 1F1B at most p - s on stage s
  p2p         bytes each stage sends (activations forward, their gradients backward) against m x rows x T x H x 4 per
              boundary and direction (interleaved: every chunk's boundaries, V times 1F1B's)
  tokens/s    the step's tokens over the slowest stage's time, against DDP of the whole model over the same p
              processes with the same m rows split between them
The machine has 2 cores: with p = 4 processes share them, which inflates every stage's waits; read p = 2 first.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common.activation_bytes import LiveSavedBytes
from benchmarks.common.launch import results_dir, run_ranks
from hfpar.parallel.context_parallel import shift_labels
from hfpar.parallel.pipeline import PipelineChunks, PipelineRunner, PipelineStage, balanced_split
from hfpar.train.losses import shifted_lm_loss_sum

RESULTS = results_dir("pipeline")

CFG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    use_cache=False,
)
T = 256
V = 2  # chunks per rank of the interleaved schedule


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG))


def _batch(rows: int) -> dict:
    ids = torch.randint(0, CFG["vocab_size"], (rows, T), generator=torch.Generator().manual_seed(1))
    return shift_labels({"input_ids": ids, "labels": ids.clone()})


def _pipeline(rank: int, world: int, schedule: str, m: int) -> dict:
    torch.set_num_threads(1)
    model = _model()
    if schedule == "interleaved_1f1b":
        stage = PipelineChunks(model, rank, world, balanced_split(model, V * world))
    else:
        stage = PipelineStage(model, rank, balanced_split(model, world))
    runner = PipelineRunner(stage, list(range(world)), schedule, m)
    batch = _batch(m)
    runner.train(batch, shifted_lm_loss_sum, 1.0)  # warm-up step
    stage.zero_grad(set_to_none=True)
    runner.wait_s, runner.sent_bytes = 0.0, 0
    dist.barrier()
    t0 = time.perf_counter()
    with LiveSavedBytes(stage) as live:
        runner.train(batch, shifted_lm_loss_sum, 1.0)
    dt = time.perf_counter() - t0
    return {
        "stage": rank,
        "idle": runner.wait_s / dt,
        "peak_bytes": live.peak,
        "sent_bytes": runner.sent_bytes,
        "seconds": dt,
    }


def _ddp(rank: int, world: int, m: int) -> dict:
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    batch = {k: v.chunk(world)[rank] for k, v in _batch(m).items()}
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        for row in range(batch["input_ids"].shape[0]):  # one row at a time, as the pipeline
            loss, _ = shifted_lm_loss_sum(
                model(input_ids=batch["input_ids"][row : row + 1]).logits, batch["labels"][row : row + 1]
            )
            loss.backward()
        dt = time.perf_counter() - t0
    return {"seconds": dt}


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    act = T * CFG["hidden_size"] * 4  # one row's boundary tensor, bytes
    for p in (2, 4):
        for mult in (1, 2, 4):
            m = mult * p
            ddp_s = max(r["seconds"] for r in run_ranks(_ddp, p, m, timeout=1800))
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
                stages = run_ranks(_pipeline, p, schedule, m, timeout=1800)
                step_s = max(s["seconds"] for s in stages)
                v = V if schedule == "interleaved_1f1b" else 1
                for s in stages:
                    virtual = range(s["stage"], v * p, p)  # the rank's (virtual) stages
                    boundaries = sum((u > 0) + (u < v * p - 1) for u in virtual)
                    rows.append(
                        {
                            "pp": p,
                            "m": m,
                            "schedule": schedule,
                            **s,
                            "theory_idle": (p - 1) / (v * (m + p - 1)),
                            "theory_sent_bytes": boundaries * m * act,
                            "tokens_per_s": m * T / step_s,
                            "ddp_tokens_per_s": m * T / ddp_s,
                        }
                    )
                print(rows[-len(stages) :], flush=True)
    (RESULTS / "schedules_cpu.json").write_text(json.dumps(rows, indent=2))
    md = [
        "# Pipeline parallelism (CPU, gloo, fp32)",
        "",
        "Command: `python -m benchmarks.pipeline.schedules` (Llama hidden 256, 8 layers, micro-batches of 1 x 256 "
        "tokens; "
        "2 cores: at p=4 four processes share them)",
        "",
        "| p | m | schedule | stage | idle | theory | peak activations MB | sent MB | theory MB | tokens/s | DDP "
        "tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['pp']} | {r['m']} | {r['schedule']} | {r['stage']} | {r['idle']:.2f} | {r['theory_idle']:.2f} | "
            f"{r['peak_bytes'] / 1e6:.1f} | {r['sent_bytes'] / 1e6:.2f} | {r['theory_sent_bytes'] / 1e6:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['ddp_tokens_per_s']:.0f} |"
        )
    first = {(r["pp"], r["m"], r["schedule"]): r for r in rows if r["stage"] == 0}
    md += [
        "",
        "Stage 0 at m = 4p, peak activations 1F1B / GPipe: "
        + ", ".join(
            f"p={p} {first[(p, 4 * p, '1f1b')]['peak_bytes'] / first[(p, 4 * p, 'gpipe')]['peak_bytes']:.2f}"
            for p in (2, 4)
        )
        + "; interleaved 1F1B / 1F1B: "
        + ", ".join(
            f"p={p} {first[(p, 4 * p, 'interleaved_1f1b')]['peak_bytes'] / first[(p, 4 * p, '1f1b')]['peak_bytes']:.2f}"
            for p in (2, 4)
        )
        + ".",
    ]
    mean_idle = {k: sum(r["idle"] for r in rows if (r["pp"], r["m"], r["schedule"]) == k) / k[0] for k in first}
    md += [
        "",
        "Mean idle over stages at m = 4p, measured (theory): "
        + "; ".join(
            f"p={p} {s} {mean_idle[(p, 4 * p, s)]:.3f} ({first[(p, 4 * p, s)]['theory_idle']:.3f})"
            for p in (2, 4)
            for s in ("1f1b", "interleaved_1f1b")
        )
        + ".",
    ]
    (RESULTS / "schedules_cpu.md").write_text("\n".join(md) + "\n")
    import matplotlib  # noqa: PLC0415  (an optional extra, for the plot only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p, color in ((2, "b"), (4, "g")):
        for schedule, style in (("gpipe", "o--"), ("1f1b", "s-"), ("interleaved_1f1b", "^-.")):
            pts = [
                (r["m"], sum(x["idle"] for x in rows if (x["pp"], x["m"], x["schedule"]) == (p, r["m"], schedule)) / p)
                for r in rows
                if r["pp"] == p and r["schedule"] == schedule and r["stage"] == 0
            ]
            axes[0].plot(*zip(*pts), color + style, label=f"p={p} {schedule} (mean over stages)")
            mem = [
                (r["m"], r["peak_bytes"] / 1e6)
                for r in rows
                if r["pp"] == p and r["schedule"] == schedule and r["stage"] == 0
            ]
            axes[1].plot(*zip(*mem), color + style, label=f"p={p} {schedule}, stage 0")
        for v, schedule, mark in ((1, "1f1b", ":"), (V, "interleaved_1f1b", "x:")):
            theory = sorted({(r["m"], r["theory_idle"]) for r in rows if r["pp"] == p and r["schedule"] == schedule})
            axes[0].plot(*zip(*theory), color + mark, label=f"p={p} theory (p-1)/({v if v > 1 else ''}(m+p-1))")
    axes[0].set_xlabel("micro-batches m")
    axes[0].set_ylabel("idle fraction")
    axes[0].set_title("pipeline bubble")
    axes[1].set_xlabel("micro-batches m")
    axes[1].set_ylabel("MB of activations alive at peak")
    axes[1].set_title("peak activation memory, first stage")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "schedules_cpu.png", dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    main()
