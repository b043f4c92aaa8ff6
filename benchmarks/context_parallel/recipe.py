"""Context parallelism through the recipe: training tokens/s at cp = 1, 2 (ring, Ulysses) and 4 (ring) on long rows.

    python -m benchmarks.context_parallel.scaling recipe [T ...]   # -> benchmarks/results/context_parallel/recipe_cpu.*

The clm recipe (`accelerate launch ... recipes/clm.py`, fp32) trains a Llama-style model (hidden 256, 4 layers,
8 heads / 4 kv heads, the embedded tokenizer's 128-token vocabulary) on documents of about 4 x T tokens each, cut
into rows of T tokens (so rows hold one document, bar the few that straddle a boundary), one row per optimizer
step. cp=1: single.yaml, one process; cp=N: ddp.yaml, N processes, --cp_size N. Every process runs one thread
(OMP_NUM_THREADS=1), so a process stands for one device, as in benchmarks/context_parallel/attention.py: cp=2 is two
devices against cp=1's one (with OMP_NUM_THREADS = cores / processes instead, cp=1 would get the machine's every core,
and an OpenMP team on a machine other work shares stalls at every barrier).

The same load for every run: the runs of a length are interleaved, ROUNDS rounds, the order reversed every other
round (cp1, cp2, ..., cp4 then cp4, ..., cp1), and each figure is the median over every round's steps after WARMUP.
Two figures per run, both from the recipe's metrics.jsonl (rank 0's record):
  wall  tokens/s = the step's tokens / its wall time (what the recipe logs); on a machine other work shares,
        the processes' share of the cores moves it;
  CPU   tokens per CPU second of rank 0 (step_cpu_s: the process's CPU seconds in the step, all its threads,
        communication included): what a rank costs when it has its device to itself, far less sensitive to the
        other work on the machine. With one thread per process, CPU tokens/s is the per-device throughput.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common.launch import ROOT, accelerate_cmd, env
from hfpar import data

CFG = {
    "vocab_size": 128,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
STEPS, WARMUP, ROUNDS = 3, 1, 2
RUNS = {
    "cp1": ("single", 1, []),
    "cp2_ring": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ring"]),
    "cp2_ulysses": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ulysses"]),
    "cp4_ring": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ring"]),
}


def _inputs(root: Path, seq_len: int) -> tuple[str, str]:
    """(model dir, text file): the model with max positions for T, STEPS + 1 rows of documents of ~4 T tokens."""
    model = root / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CFG, max_position_embeddings=seq_len)).save_pretrained(model)
    data.load_tokenizer(None).save_pretrained(model)
    rng, words = random.Random(0), ["the", "a", "red", "big", "small", "fox", "dog", "cat", "sees", "near", "and"]
    # seq_len words: about 4.5 x seq_len characters, and the tokenizer spends about a token per character
    docs = [" ".join(rng.choice(words) for _ in range(seq_len)) + "." for _ in range((STEPS + 1) // 4 + 2)]
    text = root / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(model), str(text)


def _run(name: str, seq_len: int, model: str, text: str, out: Path) -> dict:
    config, nproc, extra = RUNS[name]
    cmd = accelerate_cmd(
        config,
        nproc,
        "clm",
        [
            "--model_name_or_path",
            model,
            "--dataset_name",
            text,
            "--max_seq_length",
            str(seq_len),
            "--per_device_train_batch_size",
            "1",
            "--max_steps",
            str(STEPS),
            "--eval_steps",
            "0",
            "--logging_steps",
            "1",
            "--save_final_model",
            "false",
            "--output_dir",
            str(out),
            *extra,
        ],
    )
    threads = 1  # one device per process
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env(cpu=False, threads=threads), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} T={seq_len} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return {"seq_len": seq_len, "run": name, "processes": nproc, "threads_per_process": threads, "steps": steps}


def _summary(runs: list[dict]) -> dict:
    """One run's rounds -> medians over their steps after WARMUP (wall and CPU), the losses of the first round."""
    kept = [s for r in runs for s in r["steps"][WARMUP:]]
    tokens = statistics.median(s["tokens_per_s"] * s["step_time_s"] for s in kept)
    wall, cpu = (statistics.median(s[k] for s in kept) for k in ("step_time_s", "step_cpu_s"))
    return {k: runs[0][k] for k in ("seq_len", "run", "processes", "threads_per_process")} | {
        "tokens_per_s": tokens / wall,
        "step_time_s": wall,
        "step_cpu_s": cpu,
        "cpu_tokens_per_s": tokens / cpu,
        "tokens_per_step": tokens,
        "samples": len(kept),
        "losses": [s["loss"] for s in runs[0]["steps"]],
        "rounds": [
            {"step_time_s": [s["step_time_s"] for s in r["steps"]], "step_cpu_s": [s["step_cpu_s"] for s in r["steps"]]}
            for r in runs
        ],
    }


def measure(lengths, rounds: int = ROUNDS, progress=None) -> dict:
    """progress: a path the summaries so far are written to after each length (should a long run be cut)."""
    rows = []
    load = {
        "start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for seq_len in lengths:
        with tempfile.TemporaryDirectory() as tmp:
            model, text = _inputs(Path(tmp), seq_len)
            done: dict[str, list] = {name: [] for name in RUNS}
            for i in range(rounds):  # interleaved: every run sees the same load
                for name in list(RUNS) if i % 2 == 0 else list(RUNS)[::-1]:
                    done[name].append(_run(name, seq_len, model, text, Path(tmp) / f"{name}_{i}"))
                    print(
                        {k: v for k, v in done[name][-1].items() if k != "steps"},
                        [(s["step_time_s"], s["step_cpu_s"]) for s in done[name][-1]["steps"]],
                        flush=True,
                    )
            rows += [_summary(done[name]) for name in RUNS]
            if progress is not None:
                progress.write_text(
                    json.dumps(
                        {
                            "rows": rows,
                            "load": {**load, "end": os.getloadavg()},
                            "steps": STEPS,
                            "warmup": WARMUP,
                            "rounds": rounds,
                        },
                        indent=2,
                    )
                )
    load["end"] = os.getloadavg()
    return {"rows": rows, "load": load, "steps": STEPS, "warmup": WARMUP, "rounds": rounds}


def from_dirs(root: Path, seq_len: int, load: dict) -> dict:
    """The measurement of a run cut short (its temporary directory kept): every run directory <name>_<round> under
    root holding a complete metrics.jsonl (STEPS steps) is summarized as measure() would."""
    done: dict[str, list] = {}
    for name, (_, nproc, _) in RUNS.items():
        for i in range(ROUNDS):
            f = root / f"{name}_{i}" / "metrics.jsonl"
            steps = [json.loads(x) for x in f.read_text().splitlines() if '"loss"' in x] if f.exists() else []
            if len(steps) == STEPS:
                done.setdefault(name, []).append(
                    {"seq_len": seq_len, "run": name, "processes": nproc, "threads_per_process": 1, "steps": steps}
                )
    rounds = min(len(v) for v in done.values())
    return {
        "rows": [_summary(v) for v in done.values()],
        "load": {**load, "end": os.getloadavg()},
        "steps": STEPS,
        "warmup": WARMUP,
        "rounds": rounds,
    }


def report(res: dict) -> list[str]:
    ld = res["load"]
    lengths = sorted({r["seq_len"] for r in res["rows"]})
    md = [
        "# Context parallelism through the recipe: tokens/s (CPU, gloo, fp32)",
        "",
        (
            f"Command: `python -m benchmarks.context_parallel.scaling recipe {' '.join(map(str, lengths))}` (clm "
            "recipe, Llama "
            f"hidden 256, 4 layers, 8 / 4 heads, one row of T tokens per step, {res['steps']} steps, "
            f"{res.get('rounds', 1)} interleaved rounds (order reversed every other round), median over the steps "
            f"after {res['warmup']}; one thread per process: a process stands for a device)"
        ),
        "",
        (
            f"{ld['date']}, {ld['cpus']} CPUs; load average (1, 5, 15 min) at the start "
            f"{', '.join(f'{x:.1f}' for x in ld['start'])}, at the end {', '.join(f'{x:.1f}' for x in ld['end'])}"
            + (
                " (the machine was shared: other processes ran beside this benchmark; the wall figures carry that "
                "load, the CPU figures far less)"
                if max(ld["start"][0], ld["end"][0]) > 0.5 * ld["cpus"]
                else ""
            )
            + ld.get("note", "")
        ),
        "",
        (
            "| T | run | processes x threads | wall tokens/s | step s | vs cp=1 | CPU tokens/s (rank 0) | step CPU s | "
            "vs cp=1 | steps (rounds x after warm-up) | losses vs cp=1 (max relative difference) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["seq_len"]: r for r in res["rows"] if r["run"] == "cp1"}
    for r in res["rows"]:
        b = base[r["seq_len"]]
        diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], b["losses"]))
        cpu = (
            f"{r['cpu_tokens_per_s']:.0f} | {r['step_cpu_s']:.2f} | {r['cpu_tokens_per_s'] / b['cpu_tokens_per_s']:.2f}"
            if "cpu_tokens_per_s" in r
            else " | | "
        )
        md.append(
            f"| {r['seq_len']} | {r['run']} | {r['processes']} x {r['threads_per_process']} | "
            f"{r['tokens_per_s']:.0f} | {r['step_time_s']:.2f} | {r['tokens_per_s'] / b['tokens_per_s']:.2f} | "
            f"{cpu} | {r.get('samples', '')} | {diff:.1e} |"
        )
    return md


def plot(res: dict, path) -> None:
    import matplotlib  # an optional extra, for the plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "tokens_per_s", "wall"), (axes[1], "cpu_tokens_per_s", "per rank CPU second")):
        for name, style in (("cp1", "k-o"), ("cp2_ring", "b-o"), ("cp2_ulysses", "c--s"), ("cp4_ring", "g-o")):
            pts = [(r["seq_len"], r[key]) for r in res["rows"] if r["run"] == name and key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=name.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(f"training tokens / s ({title})")
        ax.set_title(f"recipe tokens/s, {title} (CPU, fp32)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
