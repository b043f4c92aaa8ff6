"""The layouts the planner considers for a model and a cluster, the one it recommends, and its launch command.

    for cand in candidates(stats, gpus_per_node=8, world=8): ...      # every layout the model allows, in rule order
    best, fits = recommend(rows, budget=80 * 2**30)                   # rows: (candidate, estimate, ...); or None
    print(launch_command(best, "meta-llama/Llama-2-7b-hf", 8, 1, ...))   # accelerate launch ... recipes/sft.py ...

check_tp / check_ep refuse a degree the model cannot take, naming the valid ones (PlannerError).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfpar.backends.strategies import PLANNER_ROWS, STRATEGY
from hfpar.planner.memory import ModelStats, PlannerError, host_ram_bytes, state_bytes_per_param
from hfpar.planner.pipeline import pipeline_estimate


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
    # pipeline (over DDP): one stage per node, and powers of two up to the layers; none for a multimodal wrapper
    if stats.n_layer_params and not stats.pipeline_refusal:
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
    lora_rank: int = 0,
    moe: bool = False,
) -> str:
    """moe: PEFT's all-linear reaches the experts' weights, where PEFT refuses dropout (--lora_dropout 0)."""
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
    cmd += f" --use_peft --lora_r {lora_rank}" + (" --lora_dropout 0" if moe else "") if lora_rank else ""
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
    lora = bool(kw.get("lora_rank"))
    host = host_ram_bytes(stats, over, dp=world // pp, pp=pp, lora=lora, local=stage_params)["peak"]
    return {k: worst[k] for k in ("params", "grads", "optimizer", "buffers", "activations", "total")} | {
        "cpu": 0,
        "host": host,
    }
