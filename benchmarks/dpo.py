"""DPO throughput: hfpar's dpo recipe vs TRL 1.16's DPOTrainer, side by side in one process, on the same model, pairs
and batches (CPU, fp32, the reference model a separate frozen copy in both), checking that the per-step losses
agree (1e-4 relative) before comparing speed.

    python benchmarks/dpo.py                    # -> benchmarks/results/dpo_cpu.json / .md
    python benchmarks/dpo.py --steps 12 --rounds 3

pairs/s: the pairs of the steps after the first (warm-up: allocation, lazy init), over their wall time, and per
CPU-second of the process (all threads; on a shared machine the steadier of the two), median over rounds, hfpar
and TRL interleaved (the machine is shared: interleaving spreads its noise over both). Peak memory:
the process's peak RSS growth during the training call (ru_maxrss is per process and only grows: each trainer runs
in a fresh subprocess). TRL is run twice: with its 1.16 defaults (gradient_checkpointing on) and with
gradient_checkpointing off (hfpar's default; TRL's fastest setting here: its padding_free falls back to padding
in 1.16 and its Liger kernels are deprecated and not installed), so the comparison is against both. Both compute
the per-token log-probs their own way (TRL: its chunked fused LM head; hfpar: logits, or each pair's prompt once,
hfpar.data.preference.PairCollator share_prompt). Every run uses one thread (torch.set_num_threads(1)): on a
shared 2-core machine more threads only spin.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from hfpar.train.trainer import Trainer
from tests.helpers.trl_dpo import make_case, run_hfpar, run_trl

CONFIG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 32}


def one(kind: str, model: str, data: str, steps: int, batch: int) -> dict:
    """One training run in this process -> {pairs_per_s, peak_rss_mib, losses}."""
    out = tempfile.mkdtemp()
    torch.set_num_threads(1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if kind == "hfpar":
        cpu = []   # CPU-seconds of each optimizer step (all threads of the process)
        step = Trainer._train_step

        def timed(self, *args):
            c0 = time.process_time()
            rec = step(self, *args)
            cpu.append(time.process_time() - c0)
            return rec

        Trainer._train_step = timed
        recs = run_hfpar(model, data, out, steps=steps, batch=batch)
        Trainer._train_step = step
        wall, cpu_s = sum(r["step_time_s"] for r in recs[1:]), sum(cpu[1:])
    else:
        timing = {}
        recs = run_trl(model, data, out, steps=steps, batch=batch, timing=timing,
                       gradient_checkpointing=kind == "trl_default")
        wall, cpu_s = timing["steady_s"], timing["steady_cpu_s"]
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return {"pairs_per_s": (steps - 1) * batch / wall, "pairs_per_cpu_s": (steps - 1) * batch / cpu_s,
            "peak_rss_growth_mib": peak, "losses": [r["loss"] for r in recs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)   # kind model data: a child run
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(*a.one, a.steps, a.batch)))
        return
    root = Path(tempfile.mkdtemp())
    model, data = make_case(root, pairs=a.steps * a.batch, config_updates=CONFIG)
    kinds = ("hfpar", "trl_default", "trl_no_gc")
    runs = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for k in kinds:
            proc = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--batch", str(a.batch),
                                   "--one", k, model, data], capture_output=True, text=True, cwd=ROOT, check=False)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"{k} failed:\n{proc.stderr[-3000:]}")
            runs[k].append(json.loads(line[0][7:]))
    ref = runs["trl_default"][0]["losses"]
    worst = max(abs(x - y) / abs(y) for r in runs.values() for run in r for x, y in zip(run["losses"], ref))
    summary = {k: {"pairs_per_s": statistics.median(r["pairs_per_s"] for r in v),
                   "pairs_per_cpu_s": statistics.median(r["pairs_per_cpu_s"] for r in v),
                   "peak_rss_growth_mib": statistics.median(r["peak_rss_growth_mib"] for r in v)} for k, v in runs.items()}
    result = {"model": CONFIG, "steps": a.steps, "pairs_per_step": a.batch, "rounds": a.rounds,
              "max_rel_loss_diff_vs_trl": worst, "summary": summary, "runs": runs,
              "speedup_vs_trl_default": summary["hfpar"]["pairs_per_s"] / summary["trl_default"]["pairs_per_s"],
              "speedup_vs_trl_no_gc": summary["hfpar"]["pairs_per_s"] / summary["trl_no_gc"]["pairs_per_s"],
              "cpu_speedup_vs_trl_default": summary["hfpar"]["pairs_per_cpu_s"] / summary["trl_default"]["pairs_per_cpu_s"],
              "cpu_speedup_vs_trl_no_gc": summary["hfpar"]["pairs_per_cpu_s"] / summary["trl_no_gc"]["pairs_per_cpu_s"],
              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs (shared)",
              "command": "python benchmarks/dpo.py " + " ".join(sys.argv[1:])}
    out = ROOT / "benchmarks" / "results"
    (out / "dpo_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| trainer | pairs/s (wall) | pairs per CPU-s | peak RSS growth (MiB) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['pairs_per_s']:.2f} | {v['pairs_per_cpu_s']:.2f} | {v['peak_rss_growth_mib']:.0f} |"
              for k, v in summary.items()]
    md = (f"# DPO: hfpar vs TRL 1.16 DPOTrainer (CPU, fp32, one process)\n\n`{result['command']}`; model {CONFIG}; "
          f"{a.steps} steps x {a.batch} pairs, median of {a.rounds} interleaved rounds; per-step losses agree within "
          f"{worst:.1e} relative.\n\n" + "\n".join(lines) +
          f"\n\nhfpar / TRL, wall (CPU): {result['speedup_vs_trl_default']:.2f}x ({result['cpu_speedup_vs_trl_default']:.2f}x) "
          f"against TRL's defaults (gradient checkpointing on), {result['speedup_vs_trl_no_gc']:.2f}x "
          f"({result['cpu_speedup_vs_trl_no_gc']:.2f}x) against TRL with gradient checkpointing off\n")
    (out / "dpo_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
