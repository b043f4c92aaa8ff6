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

from dataclasses import dataclass

from hfpar.backends.strategies import PLANNER_ROWS, STRATEGY
from hfpar.context import ParallelContext
from hfpar.parallel.chunked_loss import FAMILIES as CHUNK_FAMILIES
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
from hfpar.planner.pipeline import pipeline_estimate, pipeline_section

GiB = 1024**3
RESERVE = 0.10  # of each GPU kept free: CUDA context, allocator fragmentation, NCCL buffers
# ddp fsdp2 zero1 zero2 zero3 zero3_offload (hfpar.backends.strategies)
DATA_PARALLEL = tuple(s.name for s in PLANNER_ROWS)


def valid_tp_sizes(stats: ModelStats, max_tp: int) -> list[int]:
    """TP degrees up to max_tp dividing heads, kv heads, the MLP width and the vocabulary (dense models)."""
    if stats.num_experts:
        return [1]  # hfpar shards dense Llama-family layers; MoE models use expert parallelism
    dims = (stats.heads, stats.kv_heads, stats.intermediate, stats.vocab)
    return [t for t in range(1, max_tp + 1) if all(d and d % t == 0 for d in dims)]


def check_tp(stats: ModelStats, tp: int) -> None:
    for what, d in (
        ("num_attention_heads", stats.heads),
        ("num_key_value_heads", stats.kv_heads),
        ("intermediate_size", stats.intermediate),
        ("vocab_size", stats.vocab),
    ):
        if tp < 1 or d % tp:
            valid = ", ".join(map(str, valid_tp_sizes(stats, max(stats.heads, 1))))
            raise PlannerError(f"--tp_size {tp} does not divide {what} {d} (valid: {valid})")


def check_ep(stats: ModelStats, ep: int) -> None:
    if ep == 1:
        return
    if not stats.num_experts:
        raise PlannerError(f"--ep_size {ep}: the model has no experts (dense); expert parallelism needs an MoE config")
    if stats.num_experts % ep:
        valid = ", ".join(str(e) for e in range(1, stats.num_experts + 1) if stats.num_experts % e == 0)
        raise PlannerError(f"--ep_size {ep} does not divide the {stats.num_experts} experts (valid: {valid})")


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
    trainable = lora_rank * stats.lora_unit / tp_size if lora_rank else local
    shard_p, shard_g, shard_o = (dp if sharded else 1 for sharded in s.shards)
    out = {"params": local * bp / shard_p, "grads": trainable * bg / shard_g, "optimizer": trainable * bo / shard_o}
    if s.buffers == "bucket":
        buffers = trainable * bg  # DDP's bucket copy of the gradients (gradient_as_bucket_view off)
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
    if loss_chunk_size and stats.model_type not in CHUNK_FAMILIES:
        raise PlannerError(
            f"--loss_chunk_size {loss_chunk_size}: model_type {stats.model_type!r} is not among the "
            f"families checked for the chunked loss ({', '.join(CHUNK_FAMILIES)}); pass 0 or leave it unset"
        )


@dataclass(frozen=True)
class Candidate:
    strategy: str  # data-parallel strategy = accelerate config name
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages (1F1B), each over DDP

    @property
    def spec(self):
        """The strategy's entry in hfpar.backends.strategies."""
        return STRATEGY[self.strategy]

    @property
    def label(self) -> str:
        extra = f" + TP{self.tp}" if self.tp > 1 else f" + EP{self.ep}" if self.ep > 1 else ""
        extra += f" + CP{self.cp}" if self.cp > 1 else ""
        extra += f" + PP{self.pp}" if self.pp > 1 else ""
        return self.spec.label + extra


def candidates(
    stats: ModelStats,
    gpus_per_node: int,
    world: int,
    tp_size: int | None = None,
    ep_size: int | None = None,
    cp_size: int | None = None,
    nodes: int = 1,
) -> list[Candidate]:
    """Every strategy the model allows, in the order of the recommendation rule."""

    def over(dim: str) -> list[str]:  # the strategies the planner composes with a parallel dimension
        return [s.name for s in PLANNER_ROWS if dim in s.planner_with]

    out = [Candidate(s.name) for s in PLANNER_ROWS if not s.offload]
    tps = [tp_size] if tp_size else [t for t in valid_tp_sizes(stats, gpus_per_node) if world % t == 0]
    for t in (t for t in tps if t > 1):  # TP inside a node
        out += [Candidate(s, tp=t) for s in over("tp")]
    if stats.num_experts:
        eps = (
            [ep_size]
            if ep_size
            else [
                e for e in range(2, min(world, stats.num_experts) + 1) if stats.num_experts % e == 0 and world % e == 0
            ]
        )
        out += [Candidate(s, ep=e) for e in eps if e > 1 for s in over("ep")]
    cps = [cp_size] if cp_size else [2, 4, 8]
    out += [Candidate(s, cp=c) for c in cps if c > 1 and world % c == 0 for s in over("cp")]
    if stats.n_layer_params:  # pipeline (over DDP): one stage per node, and powers of two up to the layers
        pps = sorted({nodes, 2, 4, 8})
        out += [
            Candidate(s, pp=k)
            for k in pps
            if 1 < k <= min(world, stats.n_layers) and world % k == 0
            for s in over("pp")
        ]
    return out + [Candidate(s.name) for s in PLANNER_ROWS if s.offload]


def recommend(rows: list[tuple[Candidate, dict, dict]], budget: float, nodes: int = 1) -> tuple[Candidate, bool] | None:
    """The rule: model states fit with DDP -> DDP; else, on several nodes, a pipeline with one stage per node
    (DDP inside each node: only stage-boundary activations cross the slow inter-node links, where FSDP2 / ZeRO-3
    would all-gather every layer's parameters over them each step); else FSDP2 (or ZeRO-3); still not -> TP / EP,
    then a pipeline of more stages (a model too deep for TP inside a node alone), then ZeRO-3 offload. Activation
    checkpointing only when needed. Context parallelism (CP) comes before TP / EP when activations dominate (more than
    half of FSDP2's total at the requested seq_len), after them otherwise; then a CP degree that fits without activation
    checkpointing is preferred to checkpointing. rows: (candidate, no ckpt, ckpt)."""

    def tier(r) -> str | None:  # the strategy's place in the rule (hfpar.backends.strategies)
        return r[0].spec.tier

    plain = [r for r in rows if tier(r) == "first" and r[0].tp == r[0].ep == r[0].cp == r[0].pp == 1]
    pps = [r for r in rows if r[0].pp > 1]
    per_node = [r for r in pps if nodes > 1 and r[0].pp == nodes]
    order = plain[:1] + per_node + plain[1:] + [r for r in rows if tier(r) == "fallback"]
    fsdp2 = next((r[1] for r in plain if r[0].spec.shards[0]), None)  # the plain sharded one (FSDP2)
    cp_first = fsdp2 is not None and fsdp2["activations"] > fsdp2["total"] / 2
    cps = sorted((r for r in rows if r[0].cp > 1), key=lambda r: (r[0].cp, r[0].strategy))
    mps = sorted((r for r in rows if r[0].tp > 1 or r[0].ep > 1), key=lambda r: (r[0].tp * r[0].ep, r[0].strategy))
    order += cps + mps if cp_first else mps + cps
    if cp_first:  # activations dominate: cutting the sequence beats recomputing it, if that fits outright
        for cand, plain_est, _ in plain[:1] + per_node + plain[1:] + cps:
            if plain_est["total"] <= budget:
                return cand, False
    order += [r for r in pps if r not in per_node] + [r for r in rows if tier(r) == "last"]
    for cand, plain, ckpt in order:
        if plain["total"] <= budget:
            return cand, False
        if ckpt["total"] <= budget:
            return cand, True
    return None


def launch_command(
    cand: Candidate,
    model: str,
    gpus_per_node: int,
    nodes: int,
    seq_len: int,
    batch_size: int,
    checkpointing: bool,
    mixed_precision: str,
    loss_chunk_size: int | None = None,
) -> str:
    # one GPU and a strategy that shards nothing, no model parallelism: the single-process config
    single = gpus_per_node * nodes == 1 and not any(cand.spec.shards) and cand.tp == cand.ep == cand.cp == cand.pp == 1
    cmd = (
        f"accelerate launch --config_file accelerate_configs/{'single' if single else cand.strategy}.yaml "
        f"--num_processes {gpus_per_node * nodes}"
    )
    if nodes > 1:
        cmd += (
            f" --num_machines {nodes} --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR "
            "--main_process_port 29500"
        )
    if mixed_precision == "no":
        cmd += " --mixed_precision no"
    cmd += (
        f" recipes/sft.py --model_name_or_path {model} --max_seq_length {seq_len} "
        f"--per_device_train_batch_size {batch_size}"
    )
    cmd += f" --tp_size {cand.tp}" if cand.tp > 1 else ""
    cmd += f" --ep_size {cand.ep}" if cand.ep > 1 else ""
    cmd += f" --cp_size {cand.cp}" if cand.cp > 1 else ""
    cmd += f" --pp_size {cand.pp}" if cand.pp > 1 else ""
    cmd += f" --loss_chunk_size {loss_chunk_size}" if loss_chunk_size is not None else ""
    return cmd + (" --gradient_checkpointing" if checkpointing else "")


def _pp_worst(stats: ModelStats, pp: int, world: int, **kw) -> dict[str, int]:
    """The pipeline's most loaded stage (1F1B), by total bytes, as a row of the table (host RAM: each rank reads
    only its stage's parameters)."""
    rows, _ = pipeline_estimate(stats, pp, world, schedule="1f1b", **kw)
    worst = max(rows, key=lambda r: r["total"])
    stage_params = worst["params"] / state_bytes_per_param(kw.get("mixed_precision", "bf16"))[0]
    over = next(s for s in PLANNER_ROWS if "pp" in s.planner_with)  # the data parallelism the pipeline runs over
    host = host_ram_bytes(stats, over, dp=world // pp, pp=pp, local=stage_params)["peak"]
    return {k: worst[k] for k in ("params", "grads", "optimizer", "buffers", "activations", "total")} | {
        "cpu": 0,
        "host": host,
    }


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
) -> tuple[str, Candidate | None]:
    """The readable table, the recommendation and its launch command; returns (text, recommended).
    loss_chunk_size as the recipe's option; an explicit chunk drops pipeline rows (the recipe refuses them)."""
    stats = model_stats(config)
    check_loss_chunk(stats, loss_chunk_size)
    world = num_gpus * num_nodes
    if tp_size:
        check_tp(stats, tp_size)
        if tp_size > num_gpus or world % tp_size:
            raise PlannerError(
                f"--tp_size {tp_size}: must divide the {num_gpus} GPUs of a node (TP stays inside a node)"
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
    kw.pop("lora_rank")  # hfpar's pipeline trains every parameter (LoRA with PP is refused)
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
                    lora_rank=lora_rank,
                    loss_chunk_size=loss_chunk_size,
                    **kw,
                )
                for ck in (False, True)
            ),
        )
        for c in candidates(stats, num_gpus, world, tp_size, ep_size, cp_size, num_nodes)
        if not (c.pp > 1 and (lora_rank or loss_chunk_size))
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
                else f"the recipe's chunked loss is off for model_type {stats.model_type!r})"
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
        )
    best = recommend(rows, budget, num_nodes)
    if best is None:
        lines.append("\nnothing fits: lower --batch_size / --seq_len, use more GPUs, or LoRA")
        return "\n".join(lines), None
    cand, ckpt = best
    lines += [
        "",
        f"recommended: {cand.label}" + (" with activation checkpointing" if ckpt else ""),
        launch_command(cand, model, num_gpus, num_nodes, seq_len, batch_size, ckpt, mixed_precision, loss_chunk_size),
    ]
    if lora_rank:
        lines.append("note: hfpar's recipes train every parameter; the LoRA estimate is for a PEFT LoRA run")
    return "\n".join(lines), cand
