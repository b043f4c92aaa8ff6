"""Bytes communicated per optimizer step, by collective type, and bytes held per rank: measured vs theory.

    python -m benchmarks.strategies.communication                     # 2 and 4 processes, CPU/gloo or GPUs, fp32
    python -m benchmarks.strategies.communication --nprocs 2 --strategies ddp,fsdp2
    python -m benchmarks.strategies.communication --render benchmarks/results/strategies/communication_cpu.json
                                                           # .md/.png only

Each strategy runs `accelerate launch --config_file accelerate_configs/<config>.yaml recipes/sft.py
--log_comm_bytes` (hfpar.observe.comm_stats counts what each rank hands to every collective; nothing is
estimated) on a Llama-style model big enough that DeepSpeed's ZeRO-3 partitions every matrix (its
default persistence threshold keeps tensors under 1e5 elements whole). Gradient accumulation 1,
packed sequences, fp32: Phi = parameter bytes. Theory per optimizer step, bytes each rank sends with
ring algorithms (N = data-parallel size):
    DDP        all-reduce grads                                   2 Phi (N-1)/N
    FSDP2      all-gather fwd + all-gather bwd + reduce-scatter   3 Phi (N-1)/N
    ZeRO-1/2   reduce-scatter grads + all-gather params           2 Phi (N-1)/N   (ZeRO paper)
    ZeRO-3     all-gather fwd + bwd + reduce-scatter              3 Phi (N-1)/N
    TP (N=tp)  per layer 2 all-reduces fwd + 2 bwd of B*T*H, plus embedding (fwd) and LM-head input
               (bwd): (4L + 2) x 2 (N-1)/N x B*T*H x 4 bytes per micro-batch
Composed strategies (tp = 2, dp = N / tp; Phi_local = the parameter bytes of one TP shard, i.e. the
TP-sharded matrices / tp plus the replicated norms: run_info.json `param_bytes_per_rank` of rank 0,
summed over rank 0's dp group under FSDP2, which shards it further):
    tp_ddp     ddp.yaml --tp_size 2, N = 4: the TP all-reduces above with B = global batch / dp and the
               factor (tp-1)/tp, + all-reduce of the TP shard's grads over dp: 2 Phi_local (dp-1)/dp
               (hfpar wraps DDP around the TP model on the dp group; measured through DDP's comm hook)
    tp_fsdp2   fsdp2.yaml --tp_size 2, N = 4: the same TP all-reduces + 3 Phi_local (dp-1)/dp
               (FSDP2 on the dp mesh: all-gather fwd + bwd, reduce-scatter)
Mixture of experts (`--upcycle_experts 4 --moe_top_k 2`: every MLP becomes 4 copies of itself, top-2
routing, plus a router (4, H) per layer). Phi_expert = the bytes of the 4 x L expert MLPs
(GroupedExperts modules), Phi_dense = everything else (attention, norms, embeddings, LM head, routers),
both counted on the single-process upcycled model built in this script; ep = --ep_size, EP ranks are
drawn from the N data-parallel ranks and the expert-data-parallel group (ranks holding the same
experts) has N/ep ranks:
    ep         ddp.yaml --ep_size N (N = 2, 4): dense grads all-reduced over N (DDP, experts ignored):
               2 Phi_dense (N-1)/N; expert grads all-reduced by hfpar over the N/ep ranks holding the same
               experts: 2 (Phi_expert/ep) (N/ep-1)/(N/ep) (zero here, N = ep); all-to-all: the
               routed-token minimum below
    ep_fsdp2   fsdp2.yaml --ep_size 2, N = 2: dense 3 Phi_dense (N-1)/N (FSDP2, experts left out),
               experts as above, all-to-all as above
Routed-token minimum of the all-to-all (per step, this rank): MoELayer counts, independently of the
comm counter, the token copies it routes to experts on OTHER ranks (`routed_remote_rows`) and the
copies it receives from other ranks for its experts (`received_remote_rows`), summed over layers
(metrics.jsonl `moe_routed_remote_rows` / `moe_received_remote_rows`). Dispatch sends the routed rows,
combine sends the received rows back, and backward repeats both: 2 (routed + received) x H x 4 bytes
(summed over ranks this is 4 x routed x H x 4: every routed row crosses the wire 4 times). Routing
changes from step to step, so each step's rows are paired with that step's bytes and the theory is
the routed-token minimum of the step where it is the median of steps 2-4. The per-expert count
exchange (E int64 per layer, forward) and the routers' statistics all-reduces are extra, not in the
theory. Reference under uniform routing: per layer tokens_per_rank x top_k x
(ep-1)/ep rows routed away (and as many received), tokens_per_rank = global batch x seq / N (packed).

Per-rank bytes of parameters / gradients / optimizer state (run_info.json) are compared with the
single-process values divided by N where the strategy shards them; tp_ddp / tp_fsdp2 with the plain
`tp` run at the same tp (its per-rank bytes, / dp under FSDP2); ep / ep_fsdp2 with the single-process
upcycled run scaled by (Phi_dense + Phi_expert/ep) / Phi (Phi_dense / N under FSDP2). The table also
shows the median tokens/s of steps 2-4 (metrics.jsonl `tokens_per_s`, global tokens / step time, with
the comm counter on) and the peak memory per rank (run_info.json `peak_mem_bytes_per_rank`; on CPU the
process's peak RSS, max over ranks). Writes benchmarks/results/strategies/communication_<device>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir

RESULTS = results_dir("strategies")
STRATEGIES = ["ddp", "fsdp2", "zero1", "zero2", "zero3", "tp", "tp_ddp", "tp_fsdp2", "ep", "ep_fsdp2"]
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

# Why measured / theory > 1.05, for the rows where that happens (from the measured collectives; the
# markdown prints the line only for rows over the threshold, and says so when a row has no entry).
WHY = {
    "zero1": "DeepSpeed's ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, v{ds}) never calls a reduce-scatter: "
    "with the defaults `reduce_scatter: true` and `use_multi_rank_bucket_allreduce: true`, "
    '`average_tensor` puts every gradient slice into one ("allreduce", dp group) bucket and '
    "`allreduce_and_scatter` -> `allreduce_bucket` calls `dist.all_reduce` on the whole bucket, then "
    "keeps this rank's partition: 2 Phi (N-1)/N (measured all_reduce) instead of Phi (N-1)/N; the "
    "parameter all-gather after the step matches theory. No DeepSpeed setting makes stage 1/2 call a "
    "reduce-scatter collective; `zero_optimization.use_multi_rank_bucket_allreduce: false` (a DeepSpeed "
    "JSON key, not one of Accelerate's yaml keys) sends each partition's slice to its owner with "
    "`dist.reduce` instead (checked once by hand with ZeRO-2, N=2: no gradient all-reduce, two "
    "`dist.reduce` per step whose payloads sum to Phi), which is the Phi (N-1)/N of the ZeRO paper "
    "with a bandwidth-optimal reduce. hfpar keeps DeepSpeed's default, which DeepSpeed's docs prefer "
    "for small models on many GPUs.",
}
WHY["zero2"] = WHY["zero1"]


def build_model(path: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfpar import data

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) * 4


def moe_split(path: Path) -> dict[str, int]:
    """Phi_dense / Phi_expert (bytes) of the saved model upcycled as the recipe does it, one process."""
    from transformers import LlamaForCausalLM

    from hfpar.parallel.expert_parallel import upcycle_to_moe
    from hfpar.parallel.expert_parallel.moe import GroupedExperts

    model = upcycle_to_moe(LlamaForCausalLM.from_pretrained(path), EXPERTS, TOP_K)
    expert = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    params = list(model.parameters())
    phi_expert = sum(p.numel() * 4 for p in params if id(p) in expert)
    phi_dense = sum(p.numel() * 4 for p in params if id(p) not in expert)
    return {"dense": phi_dense, "expert": phi_expert}


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


def launch(config: str, extra: list[str], n: int, model: Path, out: Path, per_device: int) -> dict:
    cmd = accelerate_cmd(
        config,
        n,
        "sft",
        [
            "--model_name_or_path",
            str(model),
            "--output_dir",
            str(out),
            "--max_steps",
            str(STEPS),
            "--per_device_train_batch_size",
            str(per_device),
            "--gradient_accumulation_steps",
            "1",
            "--eval_steps",
            "0",
            "--packing",
            "--max_seq_length",
            str(SEQ),
            "--log_comm_bytes",
            "--save_final_model",
            "false",
            *extra,
        ],
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env(cpu=False), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config} {' '.join(extra)} x{n} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "comm" in r][1:]  # step 1 builds optimizer state / first gathers
    kinds = sorted({k for r in steps for k in r["comm"]})
    measured = {k: statistics.median(r["comm"].get(k, {"wire": 0})["wire"] for r in steps) for k in kinds}
    return {
        "measured": measured,
        "info": json.loads((out / "run_info.json").read_text()),
        "steps": steps,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
    }


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--results_dir", default=str(RESULTS))
    p.add_argument("--render", metavar="JSON", help="only rewrite the .md / .png from a JSON this script wrote")
    a = p.parse_args()
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        write_report(saved["meta"], saved["results"], Path(a.results_dir))
        return
    strategies = a.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {','.join(STRATEGIES)}")
    tmp = Path(tempfile.mkdtemp(prefix="hfpar-comm-"))
    phi = build_model(tmp / "model")
    single = launch("ddp", [], 1, tmp / "model", tmp / "single", a.global_batch)["info"]  # one process: no comm
    full = {
        "params": single["param_bytes_per_rank"][0],
        "grads": single["grad_bytes_per_rank"][0],
        "optimizer": single["optimizer_state_bytes_per_rank"][0],
    }
    moe = moe_full = None
    if any(s.startswith("ep") for s in strategies):
        moe = moe_split(tmp / "model")
        info = launch("ddp", MOE_FLAGS, 1, tmp / "model", tmp / "single_moe", a.global_batch)["info"]
        moe_full = {
            "params": info["param_bytes_per_rank"][0],
            "grads": info["grad_bytes_per_rank"][0],
            "optimizer": info["optimizer_state_bytes_per_rank"][0],
        }
        print(json.dumps({"moe_phi": moe, "single_upcycled_run": moe_full}), flush=True)
    tp_refs: dict[int, dict] = {}  # tp degree -> run_info of the plain `tp` run (reference for tp_ddp / tp_fsdp2)
    results, skipped = [], []
    nprocs = [int(x) for x in a.nprocs.split(",")]
    for n in nprocs:
        for s in strategies:
            pl = plan(s, n, a.global_batch)
            if pl is None:
                print(f"skip {s} at N={n}: {SKIP_REASON[s]}", flush=True)
                skipped.append({"strategy": s, "n": n, "reason": SKIP_REASON[s]})
                continue
            per_device = a.global_batch // pl["dp"]
            r = launch(pl["config"], pl["extra"], n, tmp / "model", tmp / f"{s}_{n}", per_device)
            info = r["info"]
            if s == "tp":
                tp_refs[n] = info
            a2a_min = 0.0
            moe_rows = None
            if pl["ep"] > 1:  # routing changes every step: pair each step's rows with that step's bytes
                routed = [st["moe_routed_remote_rows"] for st in r["steps"]]
                received = [st["moe_received_remote_rows"] for st in r["steps"]]
                minimum = [2 * (x + y) * MODEL["hidden_size"] * 4 for x, y in zip(routed, received)]
                mid = sorted(range(len(minimum)), key=minimum.__getitem__)[(len(minimum) - 1) // 2]  # median step
                a2a_min = minimum[mid]
                tokens = a.global_batch * SEQ // n
                uniform = (
                    4
                    * MODEL["num_hidden_layers"]
                    * tokens
                    * TOP_K
                    * (pl["ep"] - 1)
                    / pl["ep"]
                    * MODEL["hidden_size"]
                    * 4
                )
                a2a_steps = [st["comm"]["all_to_all"]["wire"] for st in r["steps"]]
                moe_rows = {
                    "routed_per_step": routed,
                    "received_per_step": received,
                    "all_to_all_wire_per_step": a2a_steps,
                    "routed_min_bytes_per_step": minimum,
                    "median_step": mid + 2,
                    "routed": routed[mid],
                    "received": received[mid],
                    "all_to_all_wire": a2a_steps[mid],
                    "routed_min_bytes": a2a_min,
                    "tokens_per_rank": tokens,
                    "uniform_bytes": uniform,
                }
            theory = comm_theory(s, n, phi, per_device, info=info, moe=moe, a2a_min=a2a_min)
            total_m, total_t = sum(r["measured"].values()), sum(theory.values())
            ref = None
            if s in ("tp_ddp", "tp_fsdp2"):
                if pl["tp"] not in tp_refs:  # the `tp` run at this degree was not part of this invocation
                    tp_refs[pl["tp"]] = launch(
                        "ddp",
                        ["--tp_size", str(pl["tp"])],
                        pl["tp"],
                        tmp / "model",
                        tmp / f"tp_ref_{pl['tp']}",
                        a.global_batch,
                    )["info"]
                ref = tp_refs[pl["tp"]]
            held = held_expectations(s, n, pl, full, info, ref, moe, moe_full)
            row = {
                "strategy": s,
                "n": n,
                "tp": pl["tp"],
                "dp": pl["dp"],
                "ep": pl["ep"],
                "per_device_batch": per_device,
                "measured": r["measured"],
                "theory": theory,
                "ratio": total_m / total_t,
                "held": held,
                "tokens_per_s": r["tokens_per_s"],
                "peak_mem_bytes_per_rank": info["peak_mem_bytes_per_rank"],
            }
            if s in ("tp_ddp", "tp_fsdp2"):
                row["phi_local"] = phi_local(info, s, pl["tp"])
            if moe_rows is not None:
                row["moe"] = moe_rows
            print(json.dumps(row), flush=True)
            results.append(row)
    import torch

    dev = f"cuda_{torch.cuda.get_device_name(0).replace(' ', '_')}" if torch.cuda.is_available() else "cpu"
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except Exception:  # optional extra
        ds_version = "?"
    meta = {
        "command": command(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "model": MODEL,
        "phi_bytes": phi,
        "seq": SEQ,
        "steps": STEPS,
        "global_batch": a.global_batch,
        "tp": TP,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "moe_phi_bytes": moe,
        "nprocs": nprocs,
        "device": dev,
        "skipped": skipped,
    }
    out_dir = Path(a.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"communication_{dev}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    write_report(meta, results, out_dir)


def write_report(meta: dict, results: list[dict], out_dir: Path) -> None:
    """The markdown table and the plot, from what main() measured (or a saved JSON: --render)."""
    dev, phi, moe, nprocs, skipped = (meta[k] for k in ("device", "phi_bytes", "moe_phi_bytes", "nprocs", "skipped"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mb = 1 / 2**20
    lines = [
        f"# Communication per optimizer step and bytes held per rank ({dev})",
        "",
        f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}. "
        f"Llama hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}: "
        f"Phi = {phi * mb:.2f} MiB of fp32 parameters; global batch {meta['global_batch']} x {SEQ} tokens (packed), "
        "accumulation 1; medians of steps 2-4, rank 0. Wire bytes = what this rank sends with ring algorithms. "
        f"tp_ddp / tp_fsdp2: tp = {TP}, dp = N / {TP}. ep / ep_fsdp2: `--upcycle_experts {EXPERTS} "
        f"--moe_top_k {TOP_K}`"
        + (f" (Phi_dense = {moe['dense'] * mb:.2f} MiB, Phi_expert = {moe['expert'] * mb:.2f} MiB)" if moe else "")
        + f", ep = N (ep), {EP_FSDP2} (ep_fsdp2). Theory formulas: the docstring of "
        "benchmarks/strategies/communication.py. "
        "tokens/s: median of steps 2-4 of one run with the byte counter on, indicative only ("
        + (
            f"{max(nprocs)} processes share {meta['cpus']} CPUs here, so not scaling numbers; "
            if dev == "cpu" and (meta["cpus"] or 1) < max(nprocs)
            else ""
        )
        + "benchmarks/strategies/speed.py measures throughput); peak mem: largest per-rank peak "
        + ("allocated CUDA memory." if dev != "cpu" else "RSS of the process."),
        "",
        "| strategy | N | measured MiB/step (by collective) | theory MiB/step | measured / theory "
        "| tokens/s | peak mem / rank MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["measured"].items() if v > 1024)
        t = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["theory"].items() if v > 0)
        lines.append(
            f"| {r['strategy']} | {r['n']} | {m} | {t} | {r['ratio']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{max(r['peak_mem_bytes_per_rank']) * mb:.0f} |"
        )
    over = [r for r in results if r["ratio"] > 1.05]
    if over:
        lines += ["", "Rows with measured / theory > 1.05:", ""]
        groups: dict[str, list[str]] = {}
        for r in over:
            excess = ", ".join(
                f"{k} {(r['measured'].get(k, 0) - r['theory'].get(k, 0)) * mb:+.2f} MiB"
                for k in sorted(set(r["measured"]) | set(r["theory"]))
                if abs(r["measured"].get(k, 0) - r["theory"].get(k, 0)) > 1024
            )
            why = WHY.get(r["strategy"], "not explained by this harness; see the excess by collective.")
            groups.setdefault(why, []).append(f"{r['strategy']} N={r['n']} ({r['ratio']:.3f}; {excess})")
        for why, rows in groups.items():
            lines.append("- **" + "; ".join(rows) + "**. Why: " + why.format(ds=meta["deepspeed"]))
    moe_rows = [r for r in results if "moe" in r]
    if moe_rows:
        lines += [
            "",
            "MoE all-to-all, rank 0 (rows = token copies of H floats, summed over "
            f"{MODEL['num_hidden_layers']} MoE layers, counted by MoELayer, not by the comm counter; routing "
            "changes every step, so each step's rows go with that step's bytes: the step shown is the one "
            "with the median routed-token minimum, which is the theory in the table above). Routed-token "
            "minimum = 2 x (routed + received) x H x 4 bytes (dispatch + combine, forward and backward); "
            "measured - minimum = the per-expert count exchange. Uniform = what uniform routing would send: "
            "4 x layers x tokens/rank x top_k x (ep-1)/ep rows x H x 4 bytes:",
            "",
            "| strategy | N | ep | step | rows routed to other ranks | rows received | all_to_all measured "
            "bytes | routed-token minimum bytes | measured / minimum | uniform routing bytes | measured / uniform |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in moe_rows:
            mo = r["moe"]
            a2a = mo["all_to_all_wire"]
            lines.append(
                f"| {r['strategy']} | {r['n']} | {r['ep']} | {mo['median_step']} | {mo['routed']} | "
                f"{mo['received']} | {a2a:.0f} | {mo['routed_min_bytes']:.0f} | "
                f"{a2a / mo['routed_min_bytes']:.5f} | {mo['uniform_bytes']:.0f} | "
                f"{a2a / mo['uniform_bytes']:.3f} |"
            )
    lines += [
        "",
        "Bytes held per rank vs theory (single-process bytes, / N where the strategy shards them; tp_ddp / "
        "tp_fsdp2: the `tp` run's per-rank bytes at the same tp, / dp under FSDP2; ep / ep_fsdp2: the "
        "single-process upcycled run x (Phi_dense [/ N under FSDP2] + Phi_expert / ep) / Phi); worst rank's "
        "ratio, — where no expectation is defined:",
        "",
        "| strategy | N | params | grads | optimizer state |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        h = r["held"]
        cells = []
        for c in ("params", "grads", "optimizer"):
            ratio = "—" if h[c]["max_ratio"] is None else f"{h[c]['max_ratio']:.3f}"
            cells.append(f"{h[c]['per_rank'][0] * mb:.2f} MiB ({ratio})")
        lines.append(f"| {r['strategy']} | {r['n']} | " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{x['strategy']} at N={x['n']}: {x['reason']}" for x in skipped) + "."]
    (out_dir / f"communication_{dev}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(max(9, 0.75 * len(results)), 4.2))
    labels = [f"{r['strategy']}\nN={r['n']}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [sum(r["measured"].values()) * mb for r in results], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [sum(r["theory"].values()) * mb for r in results], 0.4, label="theory")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("MiB sent per rank per step")
    ax.legend()
    ax.set_title("hfpar: communication per optimizer step, measured vs theory")
    fig.tight_layout()
    fig.savefig(out_dir / f"communication_{dev}.png", dpi=120)


if __name__ == "__main__":
    main()
