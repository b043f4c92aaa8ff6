"""Memory planner: bytes per GPU of every strategy for a model, from its config alone (no weights).

    hfpar plan --model meta-llama/Llama-2-7b-hf --num_gpus 8 --gpu_memory_gb 80 --seq_len 4096

Model states (Adam): bf16 mixed precision uses the standard ZeRO accounting, 2 (bf16 params) + 2 (bf16
grads) + 12 (fp32 master weights + 2 moments) = 16 bytes/param; fp32 training 4 + 4 + 8. (Accelerate's
torch-native bf16 keeps fp32 params and grads instead, 4 + 4 + 8: the same 16 bytes, split otherwise.)
Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", eq. 1-2 (bytes per layer for 16-bit activations), with the output layer as the recipes compute it
(chunked LM loss by default); host RAM per rank as hfpar loads the model (hfpar.planner.memory). Parameter counts
come from the model built on the meta device, so every architecture (GQA, tied embeddings, MoE experts) is
counted exactly.
"""

from __future__ import annotations

from hfpar.backends.strategies import PLANNER_ROWS, STRATEGY
from hfpar.context import ParallelContext
from hfpar.planner.candidates import (  # noqa: F401  (the table's API: re-exported)
    Candidate,
    _pp_worst,
    candidates,
    check_ep,
    check_tp,
    launch_command,
    recommend,
    valid_tp_sizes,
)
from hfpar.planner.memory import (
    HOST_OVERHEAD,
    ModelStats,
    PlannerError,
    activation_bytes,  # also re-exported: hfpar.planner.table's API
    chunk_tokens,
    host_ram_bytes,
    model_stats,
    state_bytes_per_param,
)
from hfpar.planner.pipeline import pipeline_section

GiB = 1024**3
RESERVE = 0.10  # of each GPU kept free: CUDA context, allocator fragmentation, NCCL buffers
# ddp fsdp2 zero1 zero2 zero3 zero3_offload (hfpar.backends.strategies)
DATA_PARALLEL = tuple(s.name for s in PLANNER_ROWS)


def estimate(
    config,
    strategy: str,
    world_size: int,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    cp_size: int = 1,
    seq_len: int = 2048,
    batch_size: int = 1,
    mixed_precision: str = "bf16",
    lora_rank: int = 0,
    checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    loss_chunk_size: int | None = None,
) -> dict[str, int]:
    """Bytes per rank by category: params, grads, optimizer (persistent, what a rank holds between steps),
    buffers (transient: all-gathered layers, DDP gradient buckets), activations, total; cpu (bytes per
    rank kept in host RAM by offload), host (peak host RAM of the rank: hfpar.planner.memory.host_ram_bytes).
    loss_chunk_size: the recipe's option (None: auto where the recipe applies it, 0: full logits). `strategy` is a
    data-parallel one; tp_size composes with ddp and fsdp2, ep_size with ddp (what hfpar runs). cp_size: each rank holds
    seq_len / cp tokens of every row (activations and logits / cp; the ring's gathered K / V of one layer are not
    counted); FSDP2 / ZeRO shard over dp x cp. config: a transformers config or ModelStats."""
    stats = model_stats(config)
    if strategy not in DATA_PARALLEL:
        raise PlannerError(f"strategy {strategy!r}: use one of {', '.join(DATA_PARALLEL)}")
    s = STRATEGY[strategy]  # what it shards, its buffers, what the planner composes it with
    degrees = ParallelContext(world=world_size, tp=tp_size, ep=ep_size, cp=cp_size).problems()  # the runs' own check
    if degrees:
        raise PlannerError("; ".join(degrees))
    # what this estimator models (a subset of the support matrix, hfpar.backends.SUPPORT)
    if (tp_size > 1 and "tp" not in s.planner_with) or (ep_size > 1 and "ep" not in s.planner_with):
        raise PlannerError(
            f"{strategy} with tp {tp_size} / ep {ep_size}: the planner models TP with ddp or fsdp2, EP with ddp"
        )
    check_tp(stats, tp_size)
    check_ep(stats, ep_size)
    check_loss_chunk(stats, loss_chunk_size)
    bp, bg, bo = state_bytes_per_param(mixed_precision)
    dp = world_size // (tp_size * cp_size) * cp_size  # the ranks states are sharded over: dp x cp
    # parameters this rank's model replica holds after TP / EP splitting
    local = stats.n_tp_replicated + (stats.n_params - stats.n_tp_replicated) / tp_size
    local -= stats.n_expert * (1 - 1 / ep_size)
    layer = stats.largest_layer / tp_size
    # LoRA under TP (tensor_parallel/lora.py): of each adapter's r x (in + out), one factor is split and the other
    # whole (A whole on column-parallel layers, B whole on row-parallel ones): about half of it split; adapters on
    # MoE routers and experts whole (the blocks stay whole on every TP rank)
    split = stats.lora_unit - stats.lora_unit_whole
    trainable = lora_rank * (stats.lora_unit_whole + split * (1 + 1 / tp_size) / 2) if lora_rank else local
    shard_p, shard_g, shard_o = (dp if sharded else 1 for sharded in s.shards)
    out = {"params": local * bp / shard_p, "grads": trainable * bg / shard_g, "optimizer": trainable * bo / shard_o}
    if s.buffers == "bucket":
        # DDP's bucket copy of the gradients (gradient_as_bucket_view off); one process runs unwrapped (single.yaml)
        buffers = trainable * bg if world_size > 1 else 0
    elif s.buffers == "gathered":
        buffers = 2 * layer * bp + layer * bg  # gathered layer + prefetched next + its unsharded grads
    else:
        buffers = min(trainable, stats.hidden**2) * bg  # ZeRO-1/2 reduce bucket (Accelerate: hidden^2)
    cpu = 0.0
    if s.offload:
        cpu = out["params"] + out["grads"] + out["optimizer"]
        out["params"] = out["grads"] = out["optimizer"] = 0.0
    act_bytes = 2 if mixed_precision == "bf16" else 4
    out["buffers"] = buffers
    out["activations"] = activation_bytes(
        stats,
        seq_len // cp_size,
        batch_size,
        tp=tp_size,
        checkpointing=checkpointing,
        act_bytes=act_bytes,
        attn_implementation=attn_implementation,
        loss_chunk=chunk_tokens(stats, tp_size, loss_chunk_size),
        autocast=not s.bf16_weights,  # fp32 weights under autocast; FSDP2's policy and DeepSpeed compute in bf16
    )
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out["cpu"] = int(cpu)
    out["host"] = host_ram_bytes(stats, s, dp=dp, tp=tp_size, ep=ep_size, lora=bool(lora_rank), local=local, cpu=cpu)[
        "peak"
    ]
    return out


def check_loss_chunk(stats: ModelStats, loss_chunk_size: int | None) -> None:
    """The recipe's checks of --loss_chunk_size (hfpar.config, hfpar.preflight), as one-line PlannerErrors."""
    if loss_chunk_size is not None and loss_chunk_size < 0:
        raise PlannerError(f"--loss_chunk_size {loss_chunk_size}: must be >= 1 token, 0 (off) or unset (auto)")
    if loss_chunk_size and stats.chunk_problem:
        raise PlannerError(
            f"--loss_chunk_size {loss_chunk_size}: model_type {stats.model_type!r}: {stats.chunk_problem}, so the "
            "chunked loss would not compute its loss; pass 0 or leave it unset"
        )


def _lora_refused(ep: int) -> bool:
    """What the recipes refuse with the planned --use_peft (all-linear): EP, whose MoE layers would bypass adapters on
    the routers / experts (preflight; all-linear reaches them on most MoE families)."""
    return ep > 1


def memory_table(
    config,
    model: str,
    *,
    num_gpus: int,
    gpu_memory_gb: float,
    num_nodes: int = 1,
    seq_len: int = 2048,
    batch_size: int = 1,
    mixed_precision: str = "bf16",
    lora_rank: int = 0,
    tp_size: int | None = None,
    ep_size: int | None = None,
    attn_implementation: str = "sdpa",
    cp_size: int | None = None,
    loss_chunk_size: int | None = None,
    trust_remote_code: bool = False,
) -> tuple[str, Candidate | None]:
    """The readable table, the recommendation and its launch command; returns (text, recommended).
    loss_chunk_size as the recipe's option; an explicit chunk drops pipeline rows (the recipe refuses them).
    trust_remote_code: `hfpar plan --trust_remote_code`, the only way a config's auto_map code runs here."""
    stats = model_stats(config, trust_remote_code=trust_remote_code)
    check_loss_chunk(stats, loss_chunk_size)
    world = num_gpus * num_nodes
    if tp_size:
        check_tp(stats, tp_size)
        if tp_size > num_gpus or world % tp_size:
            raise PlannerError(
                f"--tp_size {tp_size}: must divide the {num_gpus} GPUs of a node (TP stays inside a node)"
            )
    if lora_rank and _lora_refused(ep_size or 1):
        raise PlannerError(
            f"--ep_size {ep_size} with --lora: the planned command trains PEFT's all-linear targets, which reach the "
            "MoE routers / experts that expert parallelism computes (the recipes run --ep_size with "
            "--lora_target_modules outside them); drop it"
        )
    if ep_size:
        check_ep(stats, ep_size)
        if world % ep_size:
            raise PlannerError(f"--ep_size {ep_size} does not divide the {world} GPUs")
    budget = gpu_memory_gb * GiB * (1 - RESERVE)
    kw = dict(
        seq_len=seq_len,
        batch_size=batch_size,
        mixed_precision=mixed_precision,
        lora_rank=lora_rank,
        attn_implementation=attn_implementation,
    )
    rows = [
        (
            c,
            *(
                _pp_worst(stats, c.pp, world, checkpointing=ck, **kw)
                if c.pp > 1
                else estimate(
                    stats,
                    c.strategy,
                    world,
                    tp_size=c.tp,
                    ep_size=c.ep,
                    cp_size=c.cp,
                    checkpointing=ck,
                    loss_chunk_size=loss_chunk_size,
                    **kw,
                )
                for ck in (False, True)
            ),
        )
        for c in candidates(stats, num_gpus, world, tp_size, ep_size, cp_size, num_nodes)
        if not (c.pp > 1 and loss_chunk_size) and not (lora_rank and _lora_refused(c.ep))
    ]
    unit, scale = ("GiB", GiB) if max(r[1]["total"] for r in rows) >= GiB else ("MiB", 1024**2)
    g = lambda b: f"{b / scale:.2f}"  # noqa: E731
    lines = [
        f"{model}: {stats.n_params / 1e9:.3f}B parameters ({stats.n_layers} layers, hidden {stats.hidden}, "
        f"{stats.heads} heads / {stats.kv_heads} kv heads, vocab {stats.vocab}"
        + (f", {stats.num_experts} experts" if stats.num_experts else "")
        + ")",
        f"{num_nodes} node(s) x {num_gpus} GPU(s) of {gpu_memory_gb:g} GiB (budget {budget / GiB:.1f} GiB: "
        f"{RESERVE:.0%} kept free); seq_len {seq_len}, batch {batch_size}/GPU, mixed precision {mixed_precision}, "
        f"{f'LoRA rank {lora_rank}' if lora_rank else 'full fine-tuning'}, Adam",
        "",
        f"{unit} per GPU    params   grads  optim  buffers  activ (ckpt)  total (ckpt)   host  fits",
    ]
    for c, plain, ck in rows:
        fits = "yes" if plain["total"] <= budget else "ckpt" if ck["total"] <= budget else "no"
        cpu = f"  + {g(plain['cpu'])} {unit} CPU RAM/GPU" if plain["cpu"] else ""
        lines.append(
            f"{c.label:<16}{g(plain['params']):>6}  {g(plain['grads']):>6} {g(plain['optimizer']):>6}  "
            f"{g(plain['buffers']):>7}  {g(plain['activations']):>5} ({g(ck['activations'])})  "
            f"{g(plain['total']):>6} ({g(ck['total'])})  {g(plain['host']):>6}  {fits}{cpu}"
        )
    chunk = chunk_tokens(stats, 1, loss_chunk_size)
    lines.append(
        "(ckpt) = with --gradient_checkpointing; activations: Korthikanti et al. 2022, "
        + ("eager attention (s x s scores stored)" if attn_implementation == "eager" else "sdpa/flash attention")
        + (
            f", chunked LM loss ({chunk} tokens/chunk at tp 1; pipelines: full logits)"
            if chunk
            else ", full fp32 logits ("
            + (
                "--loss_chunk_size 0)"
                if loss_chunk_size == 0
                else f"the recipe's chunked loss is off for model_type {stats.model_type!r}: {stats.chunk_problem})"
            )
        )
    )
    lines.append(
        f"host = peak host RAM per rank: {HOST_OVERHEAD / GiB:.2f} GiB per process + loading (fp32; whole "
        "model: DDP, ZeRO-1/2; shards: FSDP2, ZeRO-3, TP / EP, the PP stage; LoRA as its base) or offload's CPU bytes"
    )
    pp_rows = [c for c, _, _ in rows if c.pp > 1]
    if pp_rows:
        shown = next((c for c, p, _ in rows if c.pp > 1 and p["total"] <= budget), pp_rows[-1])
        lines += pipeline_section(
            stats,
            shown.pp,
            world,
            budget,
            seq_len=seq_len,
            batch_size=batch_size,
            mixed_precision=mixed_precision,
            attn_implementation=attn_implementation,
            lora_rank=lora_rank,
        )
    best = recommend(rows, budget, num_nodes)
    if best is None:
        lines.append("\nnothing fits: lower --batch_size / --seq_len, use more GPUs, or LoRA")
        return "\n".join(lines), None
    cand, ckpt = best
    lines += [
        "",
        f"recommended: {cand.label}" + (" with activation checkpointing" if ckpt else ""),
        launch_command(
            cand,
            model,
            num_gpus,
            num_nodes,
            seq_len,
            batch_size,
            ckpt,
            mixed_precision,
            loss_chunk_size,
            lora_rank,
            moe=bool(stats.num_experts),
        ),
    ]
    return "\n".join(lines), cand
