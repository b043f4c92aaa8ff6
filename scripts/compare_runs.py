"""Run a recipe with two source trees and compare the runs bit for bit: every value of metrics.jsonl (but the
timings and memory) and every tensor of the exported *.safetensors.

    python scripts/compare_runs.py --base /work/main --case sft_tp2            # one case of CASES, both trees
    python scripts/compare_runs.py --base /work/main --case all --only new     # this tree again, baselines kept

Each tree runs its own `recipes/<name>.py` with PYTHONPATH=<tree>, outputs in --out/<case>/{base,new}; a launch
with 1 process is `python recipes/<name>.py`, else `accelerate launch --config_file accelerate_configs/<cfg>.yaml`.
Exit code 0 when every compared case is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parents[1]
SHORT = [
    "--max_steps",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--logging_steps",
    "1",
    "--eval_steps",
    "2",
    "--max_eval_samples",
    "16",
]
# name -> (recipe, accelerate config or None for one process, processes, options)
CASES = {
    "sft": ("sft", None, 1, []),
    "sft_packing": ("sft", None, 1, ["--packing"]),
    "clm": ("clm", None, 1, []),
    "classify": ("classify", None, 1, []),
    "dpo_packed": ("dpo", None, 1, []),  # shared prompts, several pairs a row
    "dpo_unpacked": ("dpo", None, 1, ["--attn_implementation", "eager"]),  # one pair a row, no prompt sharing
    "dpo_moe_shared": ("dpo", None, 1, ["--upcycle_experts", "4"]),  # shared prompts, not packed (MoE)
    "dpo_precompute": ("dpo", None, 1, ["--precompute_ref_log_probs"]),
    "dpo_lora": ("dpo", None, 1, ["--use_peft", "--merge_adapter"]),
    "dpo_fsdp2": ("dpo", "fsdp2", 2, []),
    "dpo_zero3": ("dpo", "zero3", 2, ["--precompute_ref_log_probs"]),
    "dpo_pp2": ("dpo", "ddp", 2, ["--pp_size", "2"]),
    "dpo_tp2": ("dpo", "ddp", 2, ["--tp_size", "2"]),
    "dpo_cp2": ("dpo", "ddp", 2, ["--cp_size", "2"]),  # --cp_mode auto, resolved in the plan
    "sft_tp2": ("sft", "ddp", 2, ["--tp_size", "2"]),
    "sft_ep2": ("sft", "ddp", 2, ["--upcycle_experts", "4", "--ep_size", "2"]),
    "sft_pp2": ("sft", "ddp", 2, ["--pp_size", "2"]),
    "sft_cp2": ("sft", "ddp", 2, ["--cp_size", "2"]),
}
VOLATILE = {"tokens_per_s", "step_time_s", "step_cpu_s", "peak_mem_bytes", "time_s", "elapsed_s"}


def run(tree: Path, case: str, out: Path) -> None:
    recipe, cfg, nproc, opts = CASES[case]
    script = str(tree / "recipes" / f"{recipe}.py")
    flags = [*SHORT, *opts, "--output_dir", str(out), "--overwrite_output_dir"]
    if cfg is None:
        cmd = [sys.executable, script, *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(tree / "accelerate_configs" / f"{cfg}.yaml"),
            "--num_processes",
            str(nproc),
            "--mixed_precision",
            "no",
            "--main_process_port",
            "0",
            script,
            *flags,
        ]
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{case}: {tree} exited {rc} (log: {out.parent / (out.name + '.log')})")


def records(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def compare(base: Path, new: Path) -> list[str]:
    diffs = []
    a, b = records(base), records(new)
    if a != b:
        diffs += [f"metrics record {i}: {x} != {y}" for i, (x, y) in enumerate(zip(a, b)) if x != y][:5]
        if len(a) != len(b):
            diffs.append(f"metrics: {len(a)} records vs {len(b)}")
    files = sorted(p.name for p in base.glob("*.safetensors"))
    if files != sorted(p.name for p in new.glob("*.safetensors")) or not files:
        diffs.append(f"exported files differ or are missing: {files}")
    for name in files:
        ta, tb = load_file(base / name), load_file(new / name)
        if ta.keys() != tb.keys():
            diffs.append(f"{name}: tensor names differ")
        diffs += [f"{name}:{k} differs" for k in ta if k in tb and not torch.equal(ta[k], tb[k])][:5]
    return diffs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="/work/main")
    p.add_argument("--case", default="all", help="a name of CASES, comma-separated names, or all")
    p.add_argument("--only", choices=("both", "base", "new", "compare"), default="both")
    p.add_argument("--out", default="/tmp/compare_runs")
    a = p.parse_args()
    cases = list(CASES) if a.case == "all" else a.case.split(",")
    failed = 0
    for case in cases:
        d = Path(a.out) / case
        if a.only in ("both", "base"):
            run(Path(a.base), case, d / "base")
        if a.only in ("both", "new"):
            run(HERE, case, d / "new")
        if a.only == "base":
            print(f"{case}: baseline written", flush=True)
            continue
        diffs = compare(d / "base", d / "new")
        n = len(records(d / "new"))
        print(
            f"{case}: {'IDENTICAL' if not diffs else 'DIFFERENT'} ({n} metric records, "
            f"{len(list((d / 'new').glob('*.safetensors')))} safetensors)",
            flush=True,
        )
        for x in diffs:
            print("   ", x)
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
