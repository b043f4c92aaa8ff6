"""Bytes communicated per optimizer step, by collective type, and bytes held per rank: measured vs theory.

    python benchmarks/communication.py                     # 2 and 4 processes, CPU/gloo or GPUs, fp32
    python benchmarks/communication.py --nprocs 2 --strategies ddp,fsdp2

Each strategy runs `accelerate launch --config_file accelerate_configs/<s>.yaml recipes/sft.py
--log_comm_bytes` (hfpar.comm_stats counts what each rank hands to every collective; nothing is
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
Per-rank bytes of parameters / gradients / optimizer state (run_info.json) are compared with the
single-process values divided by N where the strategy shards them. Writes
benchmarks/results/communication_<device>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ["ddp", "fsdp2", "zero1", "zero2", "zero3", "tp"]
MODEL = dict(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False, use_cache=False)
SEQ, STEPS = 128, 4


def build_model(path: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfpar import data

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) * 4


def comm_theory(strategy: str, n: int, phi: int, per_device: int) -> dict[str, float]:
    f = (n - 1) / n
    if strategy == "ddp":
        return {"all_reduce": 2 * phi * f}
    if strategy in ("fsdp2", "zero3"):
        return {"all_gather": 2 * phi * f, "reduce_scatter": phi * f}
    if strategy in ("zero1", "zero2"):
        return {"reduce_scatter": phi * f, "all_gather": phi * f}
    if strategy == "tp":
        bth = per_device * SEQ * MODEL["hidden_size"] * 4
        return {"all_reduce": (4 * MODEL["num_hidden_layers"] + 2) * 2 * f * bth}
    raise ValueError(strategy)


def launch(strategy: str, n: int, model: Path, out: Path, per_device: int) -> dict:
    config = "ddp" if strategy == "tp" else strategy
    extra = ["--tp_size", str(n)] if strategy == "tp" else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(n), "--mixed_precision", "no",
           "--main_process_port", "0", str(ROOT / "recipes" / "sft.py"), "--model_name_or_path", str(model),
           "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", str(per_device),
           "--gradient_accumulation_steps", "1", "--eval_steps", "0", "--packing", "--max_seq_length", str(SEQ),
           "--log_comm_bytes", "--save_final_model", "false", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} x{n} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "comm" in r][1:]  # step 1 builds optimizer state / first gathers
    kinds = sorted({k for r in steps for k in r["comm"]})
    measured = {k: statistics.median(r["comm"].get(k, {"wire": 0})["wire"] for r in steps) for k in kinds}
    return {"measured": measured, "info": json.loads((out / "run_info.json").read_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--global_batch", type=int, default=8)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hfpar-comm-"))
    phi = build_model(tmp / "model")
    single = launch("ddp", 1, tmp / "model", tmp / "single", a.global_batch)["info"]  # one process: no comm
    full = {"params": single["param_bytes_per_rank"][0], "grads": single["grad_bytes_per_rank"][0],
            "optimizer": single["optimizer_state_bytes_per_rank"][0]}
    results = []
    for n in [int(x) for x in a.nprocs.split(",")]:
        for s in a.strategies.split(","):
            per_device = a.global_batch if s == "tp" else a.global_batch // n
            r = launch(s, n, tmp / "model", tmp / f"{s}_{n}", per_device)
            theory = comm_theory(s, n, phi, per_device)
            total_m, total_t = sum(r["measured"].values()), sum(theory.values())
            info = r["info"]
            shard = {"params": s in ("fsdp2", "zero3", "tp"), "grads": s in ("fsdp2", "zero2", "zero3", "tp"),
                     "optimizer": s != "ddp"}
            held = {}
            for cat, key in (("params", "param_bytes_per_rank"), ("grads", "grad_bytes_per_rank"),
                             ("optimizer", "optimizer_state_bytes_per_rank")):
                expect = full[cat] / n if shard[cat] else full[cat]
                held[cat] = {"per_rank": info[key], "theory": expect,
                             "max_ratio": max(b / expect for b in info[key])}
            row = {"strategy": s, "n": n, "measured": r["measured"], "theory": theory, "ratio": total_m / total_t,
                   "held": held}
            print(json.dumps(row), flush=True)
            results.append(row)
    import torch

    dev = f"cuda_{torch.cuda.get_device_name(0).replace(' ', '_')}" if torch.cuda.is_available() else "cpu"
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python " + " ".join(sys.argv), "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "model": MODEL, "phi_bytes": phi, "seq": SEQ, "steps": STEPS,
            "global_batch": a.global_batch}
    (RESULTS / f"communication_{dev}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    mb = 1 / 2**20
    lines = [f"# Communication per optimizer step and bytes held per rank ({dev})", "",
             f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}. "
             f"Llama hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}: "
             f"Phi = {phi * mb:.2f} MiB of fp32 parameters; global batch {a.global_batch} x {SEQ} tokens (packed), "
             "accumulation 1; medians of steps 2-4, rank 0. Wire bytes = what this rank sends with ring algorithms.",
             "", "| strategy | N | measured MiB/step (by collective) | theory MiB/step | measured / theory |",
             "|---|---|---|---|---|"]
    for r in results:
        m = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["measured"].items() if v > 1024)
        t = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["theory"].items())
        lines.append(f"| {r['strategy']} | {r['n']} | {m} | {t} | {r['ratio']:.3f} |")
    lines += ["", "Bytes held per rank vs theory (single-process bytes, / N where the strategy shards them); "
              "worst rank's ratio:", "", "| strategy | N | params | grads | optimizer state |", "|---|---|---|---|---|"]
    for r in results:
        h = r["held"]
        lines.append(f"| {r['strategy']} | {r['n']} | " + " | ".join(
            f"{h[c]['per_rank'][0] * mb:.2f} MiB ({h[c]['max_ratio']:.3f})" for c in ("params", "grads", "optimizer")) + " |")
    (RESULTS / f"communication_{dev}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = [f"{r['strategy']}\nN={r['n']}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [sum(r["measured"].values()) * mb for r in results], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [sum(r["theory"].values()) * mb for r in results], 0.4, label="theory")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("MiB sent per rank per step")
    ax.legend()
    ax.set_title("hfpar: communication per optimizer step, measured vs theory")
    fig.tight_layout()
    fig.savefig(RESULTS / f"communication_{dev}.png", dpi=120)


if __name__ == "__main__":
    main()
