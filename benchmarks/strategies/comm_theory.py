"""The runs of benchmarks/strategies/communication.py and what theory says each sends and holds per rank.

    plan("tp_ddp", 4, 8)                     # config, flags and degrees of one run (None: not at this N)
    comm_theory("ddp", 2, phi, per_device)   # {collective: bytes this rank sends per optimizer step}
    held_expectations(...)                   # parameter / grad / optimizer bytes per rank vs the expectation

The formulas are written out in communication.py's docstring.
"""

from __future__ import annotations

MODEL = dict(
    vocab_size=512,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    use_cache=False,
)
SEQ, STEPS = 128, 4
TP = 2  # tensor-parallel degree of tp_ddp / tp_fsdp2
EXPERTS, TOP_K = 4, 2  # --upcycle_experts / --moe_top_k of ep / ep_fsdp2
EP_FSDP2 = 2  # --ep_size of ep_fsdp2
MOE_FLAGS = ["--upcycle_experts", str(EXPERTS), "--moe_top_k", str(TOP_K)]


def plan(strategy: str, n: int, global_batch: int) -> dict | None:
    """Config file, extra flags, degrees and per-device batch of one run; None when it cannot run at n."""
    if strategy in ("ddp", "fsdp2", "zero1", "zero2", "zero3"):
        return {"config": strategy, "extra": [], "tp": 1, "dp": n, "ep": 1}
    if strategy == "tp":
        return {"config": "ddp", "extra": ["--tp_size", str(n)], "tp": n, "dp": 1, "ep": 1}
    if strategy in ("tp_ddp", "tp_fsdp2"):
        if n % TP or n // TP < 2:
            return None
        return {"config": strategy[3:], "extra": ["--tp_size", str(TP)], "tp": TP, "dp": n // TP, "ep": 1}
    if strategy == "ep":
        return {"config": "ddp", "extra": [*MOE_FLAGS, "--ep_size", str(n)], "tp": 1, "dp": n, "ep": n}
    if strategy == "ep_fsdp2":
        if n != EP_FSDP2:
            return None
        return {"config": "fsdp2", "extra": [*MOE_FLAGS, "--ep_size", str(EP_FSDP2)], "tp": 1, "dp": n, "ep": EP_FSDP2}
    raise ValueError(strategy)


SKIP_REASON = {
    "tp_ddp": f"needs tp={TP} x dp>=2 processes",
    "tp_fsdp2": f"needs tp={TP} x dp>=2 processes",
    "ep_fsdp2": f"run at {EP_FSDP2} processes only, --ep_size {EP_FSDP2} as planned in issue #7",
}


def tp_activation_bytes(per_device: int, tp: int) -> float:
    bth = per_device * SEQ * MODEL["hidden_size"] * 4
    return (4 * MODEL["num_hidden_layers"] + 2) * 2 * (tp - 1) / tp * bth


def phi_local(info: dict, strategy: str, tp: int) -> int:
    """Parameter bytes of rank 0's TP shard (FSDP2 shards it over the dp group: sum rank 0's dp group)."""
    per_rank = info["param_bytes_per_rank"]
    return sum(per_rank[0::tp]) if strategy == "tp_fsdp2" else per_rank[0]


def comm_theory(
    strategy: str,
    n: int,
    phi: int,
    per_device: int,
    *,
    info: dict | None = None,
    moe: dict | None = None,
    a2a_min: float = 0.0,
) -> dict[str, float]:
    f = (n - 1) / n
    if strategy == "ddp":
        return {"all_reduce": 2 * phi * f}
    if strategy in ("fsdp2", "zero3"):
        return {"all_gather": 2 * phi * f, "reduce_scatter": phi * f}
    if strategy in ("zero1", "zero2"):
        return {"reduce_scatter": phi * f, "all_gather": phi * f}
    if strategy == "tp":
        return {"all_reduce": tp_activation_bytes(per_device, n)}
    if strategy in ("tp_ddp", "tp_fsdp2"):
        dp = n // TP
        fdp, local = (dp - 1) / dp, phi_local(info, strategy, TP)
        act = tp_activation_bytes(per_device, TP)
        if strategy == "tp_ddp":
            return {"all_reduce": act + 2 * local * fdp}
        return {"all_reduce": act, "all_gather": 2 * local * fdp, "reduce_scatter": local * fdp}
    if strategy in ("ep", "ep_fsdp2"):
        ep = n if strategy == "ep" else EP_FSDP2
        edp = n // ep
        expert = 2 * moe["expert"] / ep * (edp - 1) / edp
        if strategy == "ep":
            return {"all_reduce": 2 * moe["dense"] * f + expert, "all_to_all": a2a_min}
        return {
            "all_gather": 2 * moe["dense"] * f,
            "reduce_scatter": moe["dense"] * f,
            "all_reduce": expert,
            "all_to_all": a2a_min,
        }
    raise ValueError(strategy)


def held_expectations(
    s: str, n: int, p: dict, full: dict, info: dict, tp_ref: dict | None, moe: dict | None, moe_full: dict | None
) -> dict:
    """{category: {"per_rank", "theory" (rank 0's, or None), "max_ratio" (or None)}}."""
    out = {}
    for cat, key in (
        ("params", "param_bytes_per_rank"),
        ("grads", "grad_bytes_per_rank"),
        ("optimizer", "optimizer_state_bytes_per_rank"),
    ):
        per_rank = info[key]
        if s in ("tp_ddp", "tp_fsdp2"):
            if tp_ref is None:
                expect = None
            else:  # rank r holds TP shard r % tp; FSDP2 splits it over the dp ranks
                div = p["dp"] if s == "tp_fsdp2" else 1
                expect = [tp_ref[key][r % p["tp"]] / div for r in range(n)]
        elif s in ("ep", "ep_fsdp2"):
            dense = moe["dense"] / (n if s == "ep_fsdp2" else 1)
            frac = (dense + moe["expert"] / p["ep"]) / (moe["dense"] + moe["expert"])
            expect = [moe_full[cat] * frac] * n
        else:
            shard = {
                "params": s in ("fsdp2", "zero3", "tp"),
                "grads": s in ("fsdp2", "zero2", "zero3", "tp"),
                "optimizer": s != "ddp",
            }
            expect = [full[cat] / n if shard[cat] else full[cat]] * n
        out[cat] = {
            "per_rank": per_rank,
            "theory": None if expect is None else expect[0],
            "max_ratio": None if expect is None else max(b / e for b, e in zip(per_rank, expect)),
        }
    return out
