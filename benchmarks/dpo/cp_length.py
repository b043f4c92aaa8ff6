"""DPO under context parallelism: per-rank memory of a training step against the pair's length at cp = 1, 2, 4, and
the longest pair that trains within a fixed per-rank memory budget (CPU, gloo, fp32).

    python -m benchmarks.dpo.cp_length          # -> benchmarks/results/dpo/cp_length_cpu.{json,md,png}
    python -m benchmarks.dpo.cp_length --budget_mib 40 --runs cp1,cp2_ring,cp4_ring
    python -m benchmarks.dpo.cp_length --report       # the .md and .png again from the .json

The dpo recipe (its entry point hfpar.recipe.main("dpo", argv), as recipes/dpo.py calls it) under `accelerate
launch`, one launch per configuration, every length of the search a recipe run in that launch (the workers'
start-up paid once, Accelerate's state reset between runs, the process group kept: tests/helpers/recipe_runs.py):
  cp1          single.yaml, 1 process (the recipe's cp=1 rows: each pair's prompt computed once, a (1, 1, T, T)
               block mask; hfpar.data.preference.PairCollator share_prompt)
  cpN_ring     ddp.yaml, N processes, --cp_size N --cp_mode ring (dp = 1): the row prompt + chosen | prompt +
               rejected, the two sequences packed as documents, cut load-balanced over the N ranks
  cpN_ulysses  the same with --cp_mode ulysses
A small Llama built from a config (hidden 64, 2 layers, 4 heads / 2 kv heads of 16, the embedded 128-token
character tokenizer; nothing downloaded), fp32, one thread per process (a process stands for a device), 2 pairs of
the same length L (prompt L/4, chosen and rejected 3L/8 tokens each; standard-format text of random letters, the
eos appended), batch 1, 2 optimizer steps (AdamW, lr 1e-3 constant, clipping at 1.0), reference = the frozen copy.

Memory (per rank, of the second step, whose start already holds the model, the reference copy, the AdamW state):
torch.profiler's memory events (profile_memory=True) over the whole step, collation, reference forward, policy
forward and backward, clipping and the optimizer step included: the peak of the running sum of the bytes the CPU
allocator hands out during the step minus those of them it takes back (the profiler reports no free of a block
allocated before it started), i.e. the step's peak of live tensor bytes above what it started with. Exact, and
for cp1 and ring the same bytes at the same length whatever else runs on the machine (Ulysses' peaks differ
between ranks by up to a quarter and from run to run, timing-dependent around its all-to-alls), which RSS is not: glibc
keeps freed blocks for reuse, so RSS after the first step already holds the first step's free space and a later step's
growth hides in it. As a cross-check the process's RSS high-water mark over the same step (reset before it through
/proc/self/clear_refs, minus the RSS at its start; glibc's mmap threshold fixed at 64 KiB so that tensor buffers
are returned at free) is recorded too; it differs both ways: it adds the allocator's, gloo's and the profiler's
own memory (a few MiB) and misses zeroed pages never touched.
The figure of a (configuration, length) is the largest over its ranks (every rank's is in the JSON).

Budget: --budget_mib per rank (default 12 MiB of step memory); for each configuration the lengths double from
--base until one exceeds it (or --cap), then 3 bisection steps between the last that fits and the first that does
not: the limit to 1/8 of that doubling bracket (lengths rounded to 16 tokens). Configurations after cp1 also run
cp1's lengths that fit, so that every length cp1 fits is compared: each (configuration, length) the losses and grad
norms of both steps against cp1's at the same length (1e-4 relative: the contract, the same training), asserted at
the end, after the results are written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir
from benchmarks.dpo.cp_length_report import limits, parity, plot, report
from benchmarks.dpo.cp_length_spec import (
    BISECT,
    CONFIG,
    FLAGS,
    MEASURED_STEP,
    ROUND,
    RUNS,
    TOL,
    data_file,
    pairs,  # noqa: F401  (tests/unit/test_dpo_cp_length.py reads it here)
)
from benchmarks.dpo.trl_compare import _reset_accelerate, make_case
from hfpar.observe.plot import human_bytes

RESULTS = results_dir("dpo")


# ------------------------------------------------------------------------------------------------ one rank
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _measure(fn):
    """fn() under torch.profiler's memory events -> (its result, peak live tensor bytes above the start, RSS
    high-water mark above the start)."""
    from torch.profiler import ProfilerActivity, profile

    rss0 = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    hwm = _rss_kib("VmHWM")
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return out, peak, (hwm - rss0) * 1024


def child(spec_path: str) -> None:
    """In every process of a launch: the search, each length a recipe run; rank 0 prints a RESULT line per run."""
    import torch
    import torch.distributed as dist

    from hfpar import recipe
    from hfpar.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    root, budget = Path(spec["root"]), spec["budget_bytes"]
    torch.set_num_threads(1)
    steps: list[dict] = []
    step = Trainer._train_step

    def measured(self, i, *rest):
        if i != MEASURED_STEP:
            rec = step(self, i, *rest)
        else:
            rec, peak, rss = _measure(lambda: step(self, i, *rest))
            rec = {**rec, "peak_bytes": peak, "rss_peak_bytes": rss}
        steps.append(rec)
        return rec

    Trainer._train_step = measured
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the recipe's call at its end: the group serves every run
    done: dict[int, dict] = {}
    known = {r["length"]: r for r in spec.get("known", [])}

    def run(length: int) -> bool:
        if length in done:
            return done[length]["fits"]
        if length in known:  # measured by an earlier attempt of this launch
            done[length] = known[length]
            return done[length]["fits"]
        steps.clear()
        _reset_accelerate()
        out = root / f"{spec['name']}_{spec['attempt']}" / str(length)
        t0 = time.perf_counter()
        recipe.main(
            "dpo",
            [
                *FLAGS,
                "--model_name_or_path",
                spec["model"],
                "--dataset_name",
                data_file(root, length),
                "--output_dir",
                str(out),
                *spec["flags"],
            ],
        )
        mine = steps[MEASURED_STEP]
        peaks = torch.tensor([[mine["peak_bytes"], mine["rss_peak_bytes"]]], dtype=torch.float64)
        if dist.is_initialized():  # every rank's figures (ranks = cp: dp = 1)
            every = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
            dist.all_gather(every, peaks)
            peaks = torch.cat(every)
        per_rank = [[int(x) for x in col] for col in peaks.T.tolist()]
        row = {
            "run": spec["name"],
            "length": length,
            "row_tokens": round(steps[0]["tokens_per_s"] * steps[0]["step_time_s"]),
            "peak_bytes": max(per_rank[0]),
            "rss_peak_bytes": max(per_rank[1]),
            "fits": max(per_rank[0]) <= budget,
            "peak_bytes_per_rank": per_rank[0],
            "rss_peak_bytes_per_rank": per_rank[1],
            "losses": [s["loss"] for s in steps],
            "grad_norms": [s["grad_norm"] for s in steps],
            "step_time_s": [s["step_time_s"] for s in steps],
            "wall_s": time.perf_counter() - t0,
        }
        done[length] = row
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("RESULT " + json.dumps(row), flush=True)
        return row["fits"]

    try:
        length, last_fit, first_fail = spec["base"], None, None
        while True:  # doubling
            if run(length):
                last_fit = length
                if length * 2 > spec["cap"]:
                    break
                length *= 2
            else:
                first_fail = length
                break
        lo, hi = last_fit or 0, first_fail
        for _ in range(BISECT if hi is not None else 0):
            mid = (lo + hi) // 2 // ROUND * ROUND
            if mid <= lo or mid >= hi:
                break
            lo, hi = (mid, hi) if run(mid) else (lo, mid)
        for extra in spec["also"]:  # cp1's lengths that fit: every one compared
            run(extra)
    finally:
        dist.destroy_process_group = destroy
        if dist.is_initialized():
            destroy()


# ------------------------------------------------------------------------------------------------ the driver
def launch(name: str, spec: dict, root: Path, bar, attempt: int = 0) -> tuple[list[dict], str | None]:
    """One accelerate launch of `name`'s search -> (its rows: rank 0's RESULT lines, streamed to the progress bar;
    None, or the tail of the launch's log if it failed). spec["known"]: rows of an earlier attempt, not rerun."""
    config, nproc, flags = RUNS[name]
    path = root / f"{name}_{attempt}.json"
    path.write_text(json.dumps({**spec, "name": name, "flags": flags, "attempt": attempt}))
    cmd = accelerate_cmd(config, nproc, "benchmarks.dpo.cp_length", ["--child", str(path)])
    e = dict(env(), MALLOC_MMAP_THRESHOLD_="65536")  # tensor buffers mmap'd, returned at free: RSS follows them
    rows, log_path = [], root / f"{name}_{attempt}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=log, text=True)
        for line in proc.stdout:
            if line.startswith("RESULT "):
                rows.append(json.loads(line[7:]))
                r = rows[-1]
                bar.set_postfix_str(f"{name} L={r['length']} {human_bytes(r['peak_bytes'])}")
                bar.update(1)
        proc.wait()
    if proc.returncode == 0:
        return rows, None
    tail = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip() and "it/s" not in x]
    return rows, f"exit {proc.returncode}: " + " | ".join(tail[-40:])


def search(name: str, spec: dict, root: Path, bar, failures: list) -> list[dict]:
    """`name`'s rows; a launch that dies (seen once: a 4-process run aborted in C++, "terminate called without an
    active exception") is launched again, at most twice, its finished lengths kept (the search is deterministic:
    it takes the same path through them)."""
    known: dict[int, dict] = {}
    for attempt in range(3):
        rows, error = launch(name, {**spec, "known": list(known.values())}, root, bar, attempt)
        known.update({r["length"]: r for r in rows})
        if error is None:
            return list(known.values())
        failures.append({"run": name, "attempt": attempt, "lengths_done": sorted(known), "error": error[-4000:]})
        bar.write(f"{name}: launch {attempt} failed, {len(known)} lengths done: {error[-300:]}")
    raise SystemExit(f"{name} failed three times:\n{error[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget_mib", type=float, default=12.0, help="per-rank step memory budget (MiB)")
    ap.add_argument("--base", type=int, default=448, help="first length of the doubling")
    ap.add_argument("--cap", type=int, default=16384, help="no length above it")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma separated, of {', '.join(RUNS)} (cp1 first)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of cp_length_cpu.{json,md,png}")
    ap.add_argument(
        "--workdir", help="keep the model, pairs, runs and launch logs there (default: a temporary directory)"
    )
    ap.add_argument(
        "--report", action="store_true", help="only rewrite the .md and .png from the --out directory's .json"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    out = Path(a.out)
    if a.report:
        res = json.loads((out / "cp_length_cpu.json").read_text())
        (out / "cp_length_cpu.md").write_text(report(res))
        plot(res, out / "cp_length_cpu.png")
        return
    from tqdm import tqdm

    names = a.runs.split(",")
    bad = [n for n in names if n not in RUNS]
    if bad or names[0] != "cp1":
        raise SystemExit(f"--runs {a.runs!r}: names of {', '.join(RUNS)}, cp1 first (the reference)")
    t0, load0 = time.perf_counter(), os.getloadavg()
    budget = int(a.budget_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model, _ = make_case(root, config_updates=CONFIG, rows=[])
        spec = {"root": str(root), "model": model, "budget_bytes": budget, "base": a.base, "cap": a.cap, "also": []}
        rows, failures = [], []
        with tqdm(total=None, desc="dpo cp length", unit="run") as bar:
            for n in names:
                rows += search(n, spec, root, bar, failures)
                if n == "cp1":
                    spec["also"] = sorted(r["length"] for r in rows if r["fits"])
    res = {
        "command": command(),
        "model": CONFIG,
        "budget_bytes": budget,
        "base": a.base,
        "cap": a.cap,
        "bisect_steps": BISECT,
        "measured_step": MEASURED_STEP + 1,
        "flags": FLAGS,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load": [load0[0], os.getloadavg()[0]],
        "minutes": (time.perf_counter() - t0) / 60,
        "limits": limits(rows, names, a.cap),
        "parity": parity(rows),
        "rows": rows,
        "failed_launches": failures,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cp_length_cpu.json").write_text(json.dumps(res, indent=1) + "\n")
    md = report(res)
    (out / "cp_length_cpu.md").write_text(md)
    plot(res, out / "cp_length_cpu.png")
    print(md)
    bad = [p for p in res["parity"] if p["max_rel_diff"] > TOL]
    assert not bad, f"not the same training as cp1: {bad}"


if __name__ == "__main__":
    main()
