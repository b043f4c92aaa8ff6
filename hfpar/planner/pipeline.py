"""Pipeline parallelism in `hfpar plan`: bytes per stage, activations in flight per schedule, the bubble.

    rows, bubble = pipeline_estimate(stats, pp=4, world=8, schedule="1f1b", seq_len=4096, batch_size=8)

What hfpar's pipeline (hfpar.parallel.pipeline, over DDP) holds on the ranks of stage s:
  params / grads / optimizer   the stage's layers (cut as hfpar cuts them: balanced by parameter count, the input
                               embedding counted on the first stage, final norm + LM head on the last; a tied
                               embedding is held by both), x the bytes per parameter of memory.state_bytes_per_param
  activations                  each micro-batch (batch_size / m rows) keeps its layers' activations (Korthikanti et
                               al. 2022, as memory.activation_bytes) from its forward to its backward; the schedule
                               decides how many are in flight: GPipe all m, 1F1B p - s, interleaved 1F1B Megatron's
                               warm-up (p - s - 1) x 2 + (V - 1) x p + 1 chunk micro-batches (each 1/V of the
                               stage's layers). Counted by walking the runner's own order (schedule_order), the last
                               stage's fp32 logits included (the recipe's chunked LM loss is off with pp > 1:
                               hfpar.parallelize.chunk_loss; the last stage's loss takes the full logits).
  bubble                       (p - 1) / (m + p - 1) for GPipe and 1F1B, divided by V for interleaved 1F1B
"""

from __future__ import annotations

from dataclasses import replace

from hfpar.parallel.pipeline.schedule import SCHEDULES, schedule_order
from hfpar.parallel.pipeline.stage import split_by_cost
from hfpar.planner.memory import PlannerError, activation_bytes, state_bytes_per_param

GiB = 1024**3


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step when stages cost the same (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual_stages * (microbatches + pp - 1))


def default_microbatches(pp: int, batch_size: int, schedule: str) -> int:
    """The recipe's default (hfpar.parallel.pipeline.microbatches): at most 2 x pp dividing the batch, a multiple
    of pp for interleaved 1F1B (0: none)."""
    step = pp if schedule == "interleaved_1f1b" else 1
    return max((d for d in range(step, min(2 * pp, batch_size) + 1, step) if batch_size % d == 0), default=0)


def _split(costs: list[float], stages: int) -> list[int]:
    return split_by_cost(costs, stages)


def pipeline_estimate(
    stats,
    pp: int,
    world: int,
    *,
    schedule: str = "1f1b",
    microbatches: int = 0,
    virtual_stages: int = 2,
    seq_len: int = 2048,
    batch_size: int = 1,
    mixed_precision: str = "bf16",
    checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    lora_rank: int = 0,
) -> tuple[list[dict], float]:
    """([bytes per rank of stage s, by category, + "layers" and "in_flight"] for s in stages, bubble fraction);
    PlannerError (one line) for a degree or micro-batch count hfpar's preflight would refuse. lora_rank: grads and
    optimizer hold the stage's adapters only (rank x (in + out) per linear weight of its layers: the stage's share
    of stats.lora_unit; the embedding and the head hold none), the frozen weights as in full training."""

    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    if schedule not in SCHEDULES:
        raise PlannerError(f"--pp_schedule {schedule!r}: valid values are {', '.join(SCHEDULES)}")
    if stats.pipeline_refusal:
        raise PlannerError(f"--pp_size {pp}: {stats.pipeline_refusal}")
    if pp < 2 or world % pp:
        raise PlannerError(f"--pp_size {pp}: must be >= 2 and divide the {world} GPUs")
    if pp * v > stats.n_layers:
        raise PlannerError(f"--pp_size {pp} x {v} chunks: the model has {stats.n_layers} layers, fewer than the stages")
    m = microbatches or default_microbatches(pp, batch_size, schedule)
    if not m:
        raise PlannerError(
            f"--batch_size {batch_size}: interleaved 1F1B needs micro-batches in multiples of --pp_size {pp}"
        )
    if batch_size % m or (v > 1 and m % pp):
        raise PlannerError(
            f"--pp_microbatches {m}: must divide --batch_size {batch_size}"
            + (f" and be a multiple of --pp_size {pp} (interleaved)" if v > 1 else "")
        )
    bp, bg, bo = state_bytes_per_param(mixed_precision)
    act = 2 if mixed_precision == "bf16" else 4
    rows_mb = batch_size // m
    # activations of one micro-batch: kept per layer, and the one layer recomputed at a time under checkpointing
    one = dict(
        seq_len=seq_len,
        batch_size=rows_mb,
        checkpointing=checkpointing,
        act_bytes=act,
        attn_implementation=attn_implementation,
    )
    transient = activation_bytes(replace(stats, n_layers=0, vocab=0), **one) if checkpointing else 0
    per_layer = activation_bytes(replace(stats, n_layers=1, vocab=0), **one) - transient
    logits = 4 * seq_len * rows_mb * stats.vocab
    # parameters: equal layers; what is not a layer nor the embedding (final norm) goes with the head
    layer_params = stats.n_layer_params / stats.n_layers
    head = stats.n_head + (stats.n_params - stats.n_layer_params - stats.n_embed - stats.n_head_untied)
    n = pp * v
    costs = [layer_params] * stats.n_layers
    costs[0] += stats.n_embed
    costs[-1] += head
    bounds = _split(costs, n)
    out = []
    for s in range(pp):
        chunks = [(bounds[c * pp + s + 1] - bounds[c * pp + s], c * pp + s) for c in range(v)]
        layers = sum(k for k, _ in chunks)
        params = layers * layer_params + (stats.n_embed if s == 0 else 0) + (head if s == pp - 1 else 0)
        live = peak = count = peak_count = 0
        for kind, _, c in schedule_order(schedule, s, pp, m, v):
            k, virtual = chunks[c]
            b = k * per_layer + (logits if virtual == n - 1 else 0)
            live, count = (live + b, count + 1) if kind == "F" else (live - b, count - 1)
            peak, peak_count = max(peak, live), max(peak_count, count)
        dp = world // pp
        trainable = lora_rank * stats.lora_unit * layers / stats.n_layers if lora_rank else params
        row = {
            "params": params * bp,
            "grads": trainable * bg,
            "optimizer": trainable * bo,
            "buffers": trainable * bg if dp > 1 else 0,  # the flat bucket of hfpar's dp all-reduce
            "activations": peak + transient,
        }
        row = {key: int(val) for key, val in row.items()}
        row["total"] = sum(row.values())
        out.append({**row, "layers": layers, "in_flight": peak_count})
    return out, bubble_fraction(pp, m, v)


def pipeline_section(stats, pp: int, world: int, budget: float, **kw) -> list[str]:
    """Lines of the table: the stages of pp under each schedule (GiB per GPU of the stage's ranks) and the bubble."""

    lines = [
        "",
        f"pipeline, pp {pp} (DDP over {world // pp} rank(s) per stage): GiB per GPU of each stage, "
        "micro-batches in flight (interleaved: chunk micro-batches), bubble",
    ]
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        try:
            rows, bubble = pipeline_estimate(stats, pp, world, schedule=schedule, **kw)
        except PlannerError as e:
            lines.append(f"  {schedule:<17}{e}")
            continue
        stages = "  ".join(f"{r['total'] / GiB:.2f} ({r['in_flight']})" for r in rows)
        fits = "yes" if max(r["total"] for r in rows) <= budget else "no"
        lines.append(f"  {schedule:<17}{stages}   bubble {bubble:.1%}   fits {fits}")
    return lines
