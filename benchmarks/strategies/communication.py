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
from benchmarks.strategies.comm_report import write_report
from benchmarks.strategies.comm_theory import (
    EXPERTS,
    MODEL,
    MOE_FLAGS,
    SEQ,
    SKIP_REASON,
    STEPS,
    TOP_K,
    TP,
    comm_theory,
    held_expectations,
    phi_local,
    plan,
)

RESULTS = results_dir("strategies")
STRATEGIES = ["ddp", "fsdp2", "zero1", "zero2", "zero3", "tp", "tp_ddp", "tp_fsdp2", "ep", "ep_fsdp2"]


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


if __name__ == "__main__":
    main()
