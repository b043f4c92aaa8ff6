"""hfpar's sft recipe vs the obvious alternatives and TRL's SFTTrainer on the same work, and what packing buys.

    python -m benchmarks.baselines.sft                         # everything, one process, fp32: ~15 min on 2 CPU cores
    python -m benchmarks.baselines.sft --sections trl --rounds 5   # only the TRL comparison (merged into the results)
    python -m benchmarks.baselines.sft --steps 4 --rounds 1 --out /tmp/bl   # a smoke run, results elsewhere

Same model (the embedded tiny Llama, same init), same tokenized data (the recipe's own hfpar.data path on the
embedded SFT set: completion-only labels), same batch, constant learning rate, same number of steps.
tokens/s = real (non-padding) input tokens / time in the training steps, counted here from the rows each step
used (not from each tool's own counter).
  frameworks: `python recipes/sft.py`, transformers.Trainer with the same collator, a hand-written Accelerate loop
              (final loss = mean of the last 10 steps; all three: mean over the batch's target tokens)
  packing:    padding tokens per batch padded, padding-free (the default), --packing, and one row per batch
              (hfpar_varlen, unpacked and packed), hfpar's tokens/s in each
  trl:        TRL's SFTTrainer (`pip install trl`, for this benchmark only; hfpar never depends on it) against
              hfpar, each in its default configuration and packed, in fresh processes, `--rounds` rounds whose
              order alternates (ABAB, then BABA) so that machine load falls on both alike. TRL gets the recipe's
              tokenized rows (labels included, so completion-only loss is the same token set) and, unpacked, in
              hfpar's sampler order through a sequential sampler: both see the same batches, and their per-step
              losses are compared. TRL defaults that change the work are set to hfpar's: fp32 (TRL: bf16) and
              no gradient checkpointing (TRL: on); both clip at 1.0 and use their default AdamW (fused).
              Ratios hfpar / TRL are taken within each round (default vs default, packed vs packed); the results
              give their median and min-max over the rounds.
Writes benchmarks/results/baselines/sft_<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import torch

from benchmarks.baselines.sft_runs import (
    BS,
    LR,
    SEQ,
    STEPS,
    padding_fraction,
    run_accelerate_loop,
    run_hfpar,
    run_trainer,
)
from benchmarks.baselines.sft_trl import TRL_CASES, compare_trl, trl_worker
from benchmarks.common.launch import command, results_dir

RESULTS = results_dir("baselines")
TRL_STEPS = 100
SECTIONS = ("frameworks", "packing", "trl")


# ----------------------------------------------------------------------------------------------- report
def markdown(res: dict, dev: str) -> str:
    meta = res["meta"]
    lines = [
        f"# hfpar vs transformers.Trainer, a plain Accelerate loop and TRL's SFTTrainer ({dev}, one process, fp32)",
        "",
        f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}"
        + (f", TRL {meta['trl']}" if meta.get("trl") else "")
        + f". Embedded tiny Llama and SFT data, batch {BS}, "
        f"constant lr {LR}, max_seq_length {SEQ}. tokens/s: real (non-padding) input tokens per second of "
        "training steps, counted from the rows each step used.",
        "",
    ]
    if "frameworks" in res:
        lines += [
            f"{meta['steps']} steps, no clipping:",
            "",
            "| run | tokens/s | loss (mean of last 10 steps) |",
            "|---|---|---|",
        ]
        lines += [f"| {k} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |" for k, v in res["frameworks"].items()]
        lines.append("")
    if "packing" in res:
        lines += [
            "Packing (hfpar sft recipe, same batch and max_seq_length):",
            "",
            "| mode | padding tokens per batch | tokens/s (real tokens) | loss (last 10) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['padding_fraction']:.1%} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |"
            for k, v in res["packing"].items()
        ]
        lines.append("")
    if "trl" in res:
        t = res["trl"]
        lines += [
            f"## hfpar vs TRL SFTTrainer: {t['steps']} steps, clipping at 1.0, {t['rounds']} alternating rounds",
            "",
            "| run | tokens/s median (min-max) | loss (last 10, median) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['tokens_per_s']['median']:.0f} ({v['tokens_per_s']['min']:.0f}-"
            f"{v['tokens_per_s']['max']:.0f}) | {v['final_loss']:.4f} |"
            for k, v in t["summary"].items()
        ]
        lines += ["", "| ratio of real tokens/s | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['median']:.2f}x | {v['min']:.2f}x | {v['max']:.2f}x |" for k, v in t["ratios"].items()]
        lines += [
            "",
            "Same batches, per-step loss vs TRL (default: padded), max relative difference (round 1): "
            + ", ".join(f"{k} {v:.1e}" for k, v in t["max_rel_step_loss_diff_vs_trl_padded"].items())
            + ". The packed runs see different rows per step (each tool packs its own way), so their losses "
            "are comparable only in level. Step time: hfpar's own step_time_s (collate to optimizer step); "
            "TRL's, the time between consecutive step ends (data loading, step, callbacks; it logs every 10 "
            "steps, its default). Ratios are taken within each round, then summarized.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS}; TRL section {TRL_STEPS})")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the TRL comparison (>= 3 for a spread)")
    p.add_argument("--out", default=str(RESULTS), help="results directory (merged into its existing results file)")
    p.add_argument("--trl_case", choices=list(TRL_CASES), help=argparse.SUPPRESS)  # internal: one TRL run
    p.add_argument("--trl_out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_case:
        return trl_worker(a.trl_case, a.steps or TRL_STEPS, a.trl_out)
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"--sections {','.join(bad)}: valid sections are {', '.join(SECTIONS)}")
    if "trl" in sections and importlib.util.find_spec("trl") is None:
        sys.exit(
            "baselines: TRL is not installed; `pip install trl` into this environment for the benchmark "
            "(hfpar does not depend on it), or run --sections frameworks,packing"
        )
    steps = a.steps or STEPS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(a.out) / f"sft_{dev}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res["meta"] = {
        **res.get("meta", {}),
        "command": command(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "batch": BS,
        "lr": LR,
        "max_seq_length": SEQ,
    }
    if sections != ["trl"]:
        res["meta"]["steps"] = steps
    if "frameworks" in sections:
        res["frameworks"] = {
            "hfpar sft recipe": run_hfpar([], steps),
            "transformers Trainer": run_trainer(steps),
            "hand-written Accelerate loop": run_accelerate_loop(steps),
        }
    if "packing" in sections:
        res["packing"] = {
            "padded (--padding_free false)": {
                "padding_fraction": padding_fraction("padded"),
                **run_hfpar(["--padding_free", "false"], steps),
            },
            "padding-free (default)": {"padding_fraction": padding_fraction("padding_free"), **run_hfpar([], steps)},
            "--packing": {"padding_fraction": padding_fraction("packing"), **run_hfpar(["--packing"], steps)},
            "one row (--attn_implementation hfpar_varlen)": {
                "padding_fraction": padding_fraction("one_row"),
                **run_hfpar(["--attn_implementation", "hfpar_varlen"], steps),
            },
            "--packing, one row (hfpar_varlen)": {
                "padding_fraction": padding_fraction("one_row"),
                **run_hfpar(["--packing", "--attn_implementation", "hfpar_varlen"], steps),
            },
        }
    if "trl" in sections:
        import trl

        res["meta"]["trl"] = trl.__version__
        res["trl"] = {"command": res["meta"]["command"], **compare_trl(a.steps or TRL_STEPS, a.rounds)}
    for key in ("frameworks", "packing"):
        for v in res.get(key, {}).values():
            v.pop("losses", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    text = markdown(res, dev)
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
