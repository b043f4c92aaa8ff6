"""The length search of the context-parallel benchmarks (benchmarks/dpo/cp_length.py, benchmarks/grpo/cp_length.py):
per-rank memory of a recipe's training step against the length of its rows at cp = 1, 2, 4, and the longest length
that trains within a fixed per-rank memory budget (CPU, gloo, fp32).

    CASE = LengthCase(recipe="dpo", module="benchmarks.dpo.cp_length", topic="dpo", runs=RUNS, ...)
    main(CASE, __doc__)          # the driver (argparse: --budget_mib --base --cap --runs --out --workdir --report),
                                 # and in each launched process (--child SPEC) the search itself

The recipe (its entry point hfpar.recipe.main(recipe, argv)) under `accelerate launch`, one launch per configuration,
every length of the search a recipe run in that launch (the workers' start-up paid once, Accelerate's state reset
between runs, the process group kept). Memory (per rank, of the case's measured step, whose start already holds the
model, the reference, the optimizer state): torch.profiler's memory events over the whole step: the peak of the
running sum of the bytes the CPU allocator hands out minus those it takes back, i.e. the step's peak of live tensor
bytes above what it started with; the RSS high-water mark over the same step as a cross-check. A case's `phases`
(methods marked with torch.profiler.record_function) get their own peak, above the live bytes at their start;
`budget_excludes` names those the budget does not count (GRPO's generation): `peak_bytes` is then the peak over
the rest of the step, `step_peak_bytes` the whole step's. A (configuration, length)'s figures are the largest over
its ranks (every rank's in the JSON).

Search: the lengths double from --base until one exceeds the budget (or --cap), then the case's bisection steps
(lengths rounded to ROUND tokens). Configurations after cp1 also run cp1's lengths that fit (unless the case says
not: then the doubling's lengths, which every configuration runs from the same base, are the compared ones): each
(configuration, length)'s losses and grad norms against cp1's (TOL relative; cp_length_report.parity), asserted at
the end, after the results are written (every configuration other than cp1 is: GRPO's cp1 with the full logits too).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.cp_length_report import TOL, limits, parity
from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir
from benchmarks.dpo.trl_compare import _reset_accelerate, make_case
from hfpar.observe.plot import human_bytes

BISECT, ROUND = 3, 16
TRAIN_FLAGS = [  # every length benchmark's: one micro-step a step, AdamW lr 1e-3 constant, clipping at 1.0, no eval
    *("--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--lr_scheduler_type", "constant"),
    *("--max_grad_norm", "1.0", "--eval_steps", "0", "--save_final_model", "false", "--logging_steps", "1"),
]
CP_RUNS = {  # name -> (accelerate config, processes, flags): the context-parallel configurations (dp = 1)
    "cp2_ring": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ring"]),
    "cp4_ring": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ring"]),
    "cp2_ulysses": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ulysses"]),
    "cp4_ulysses": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ulysses"]),
}


@dataclass(frozen=True)
class LengthCase:
    recipe: str  # the recipe each length runs: hfpar.recipe.main(recipe, argv)
    module: str  # the benchmark's module, launched with --child SPEC
    topic: str  # benchmarks/results/<topic>/cp_length_cpu.{json,md,png}
    runs: dict  # name -> (accelerate config, processes, recipe flags); "cp1" first
    flags: list  # every run's recipe flags
    config: dict  # the model: the embedded Llama's config with these updates (random init, seed 0)
    measured_step: int  # 0-based: the step measured
    argv: Callable[[Path, int], list]  # (workdir, length) -> the length's own recipe flags (data, lengths)
    report: Callable[[dict], str]  # the results' .md
    plot: Callable[[dict, Path], None]  # the results' .png
    phases: dict = field(default_factory=dict)  # name -> "module:Class.method", marked in the profile
    budget_excludes: tuple = ()  # phases the budget does not count
    metrics: tuple = ()  # per-step metrics kept in each row (e.g. the completions' length)
    bisect: int = BISECT  # bisection steps after the doubling
    rerun_cp1_fits: bool = True  # configurations after cp1 also run every length cp1 fits (False: the doubling's)
    defaults: dict = field(default_factory=lambda: {"budget_mib": 12.0, "base": 448, "cap": 16384})


def jsonl_once(path: Path, rows) -> str:
    """rows() as JSON Lines at path, written once (every rank writes the same bytes: replaced atomically)."""
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        os.replace(tmp, path)
    return str(path)


# ------------------------------------------------------------------------------------------------ one rank
def _rss_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def phase_peaks(memory: list[tuple[int, int]], spans: list[tuple[int, int, str]], excluded=()) -> tuple:
    """From (time, bytes) allocator events and (start, end, phase) spans -> (peak of the running sum, peak outside
    the excluded phases, {phase: its peak above the running sum at its start})."""
    marks = [(t, 1, n, None) for t, n in memory] + [(a, 0, 0, p) for a, _, p in spans]
    marks += [(b, 2, 0, p) for _, b, p in spans]
    marks.sort(key=lambda m: (m[0], m[1]))
    cur = peak = rest = 0
    base, active, phases = {}, set(), {p: 0 for _, _, p in spans}
    for _, kind, n, p in marks:
        if kind == 0:
            base[p] = cur
            active.add(p)
        elif kind == 2:
            active.discard(p)
        else:
            cur += n
            peak = max(peak, cur)
            for a in active:
                phases[a] = max(phases[a], cur - base[a])
            if not active & set(excluded):
                rest = max(rest, cur)
    return peak, rest, phases


def _measure(fn, phases: tuple, excluded: tuple):
    """fn() under torch.profiler's memory events -> (its result, {step, peak, rss and each phase's peak})."""
    from torch.profiler import ProfilerActivity, profile

    rss0 = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    hwm = _rss_kib("VmHWM")
    events = list(prof.profiler.kineto_results.events())
    memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in events if e.name() in phases]
    step, rest, peaks = phase_peaks(memory, spans, excluded)
    return out, {
        "peak": rest,
        "step_peak": step,
        "rss_peak": (hwm - rss0) * 1024,
        **{p: peaks.get(p, 0) for p in phases},
    }


def _mark(phases: dict) -> None:
    """Each phase's method runs inside record_function(phase) (its span in the profile)."""
    from torch.profiler import record_function

    for name, where in phases.items():
        mod, _, attr = where.partition(":")
        cls_name, _, meth = attr.partition(".")
        cls = getattr(importlib.import_module(mod), cls_name)
        orig = getattr(cls, meth)

        def marked(*a, _orig=orig, _name=name, **k):
            with record_function(_name):
                return _orig(*a, **k)

        setattr(cls, meth, marked)


def child(spec_path: str, case: LengthCase) -> None:
    """In every process of a launch: the search, each length a recipe run; rank 0 prints a RESULT line per run."""
    import torch
    import torch.distributed as dist

    from hfpar import recipe
    from hfpar.train.prefetch import wait_for
    from hfpar.train.trainer import Trainer

    spec = json.loads(Path(spec_path).read_text())
    root, budget = Path(spec["root"]), spec["budget_bytes"]
    torch.set_num_threads(1)
    steps: list[dict] = []
    load, step = Trainer._load_step, Trainer._train_step
    names = tuple(case.phases)
    _mark(case.phases)

    class Deferred:  # the measured step's loading (collation; GRPO: its generation), run inside its measurement
        device, done = [], None

        def __init__(self, micro):
            self.micro = micro

    def deferred_load(self, i, micro):
        return Deferred(micro) if i == case.measured_step else load(self, i, micro)

    def measured(self, i, loaded, *rest):
        if not isinstance(loaded, Deferred):
            rec = step(self, i, loaded, *rest)
        else:

            def whole_step():
                real = load(self, i, loaded.micro)
                real.device = wait_for(real.device, real.done)
                return step(self, i, real, *rest)

            rec, mem = _measure(whole_step, names, case.budget_excludes)
            rec = {**rec, "mem": mem}
        steps.append(rec)
        return rec

    Trainer._load_step, Trainer._train_step = deferred_load, measured
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
        # no batches loaded ahead in a thread: a step's loading is measured with it, in this thread
        argv = [*case.flags, "--dataloader_prefetch_factor", "0", "--model_name_or_path", spec["model"]]
        argv += ["--output_dir", str(out)]
        recipe.main(case.recipe, [*argv, *case.argv(root, length), *spec["flags"]])
        keys = ["peak", "step_peak", "rss_peak", *names]
        mine = torch.tensor([[steps[case.measured_step]["mem"][k] for k in keys]], dtype=torch.float64)
        if dist.is_initialized():  # every rank's figures (ranks = cp: dp = 1)
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            mine = torch.cat(every)
        per_rank = {k: [int(x) for x in col] for k, col in zip(keys, mine.T.tolist())}
        row = {
            "run": spec["name"],
            "length": length,
            "row_tokens": round(steps[0]["tokens_per_s"] * steps[0]["step_time_s"]),
            **{f"{k}_bytes": max(v) for k, v in per_rank.items()},
            "fits": max(per_rank["peak"]) <= budget,
            **{f"{k}_bytes_per_rank": v for k, v in per_rank.items()},
            "losses": [s["loss"] for s in steps],
            "grad_norms": [s["grad_norm"] for s in steps],
            "step_time_s": [s["step_time_s"] for s in steps],
            **{k: [s.get(k) for s in steps] for k in case.metrics},
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
        for _ in range(case.bisect if hi is not None else 0):
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
def launch(case: LengthCase, name: str, spec: dict, root: Path, bar, attempt: int = 0) -> tuple[list[dict], str | None]:
    """One accelerate launch of `name`'s search -> (its rows: rank 0's RESULT lines, streamed to the progress bar;
    None, or the tail of the launch's log if it failed). spec["known"]: rows of an earlier attempt, not rerun."""
    config, nproc, flags = case.runs[name]
    path = root / f"{name}_{attempt}.json"
    path.write_text(json.dumps({**spec, "name": name, "flags": flags, "attempt": attempt}))
    cmd = accelerate_cmd(config, nproc, case.module, ["--child", str(path)])
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


def search(case: LengthCase, name: str, spec: dict, root: Path, bar, failures: list) -> list[dict]:
    """`name`'s rows; a launch that dies (seen once: a 4-process run aborted in C++, "terminate called without an
    active exception") is launched again, at most twice, its finished lengths kept (the search is deterministic:
    it takes the same path through them)."""
    known: dict[int, dict] = {}
    for attempt in range(3):
        rows, error = launch(case, name, {**spec, "known": list(known.values())}, root, bar, attempt)
        known.update({r["length"]: r for r in rows})
        if error is None:
            return list(known.values())
        failures.append({"run": name, "attempt": attempt, "lengths_done": sorted(known), "error": error[-4000:]})
        bar.write(f"{name}: launch {attempt} failed, {len(known)} lengths done: {error[-300:]}")
    raise SystemExit(f"{name} failed three times:\n{error[-3000:]}")


def main(case: LengthCase, doc: str) -> None:
    d = case.defaults
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--budget_mib", type=float, default=d["budget_mib"], help="per-rank step memory budget (MiB)")
    ap.add_argument("--base", type=int, default=d["base"], help="first length of the doubling")
    ap.add_argument("--cap", type=int, default=d["cap"], help="no length above it")
    ap.add_argument(
        "--runs", default=",".join(case.runs), help=f"comma separated, of {', '.join(case.runs)} (cp1 first)"
    )
    ap.add_argument("--out", default=str(results_dir(case.topic)), help="directory of cp_length_cpu.{json,md,png}")
    ap.add_argument(
        "--workdir", help="keep the model, data, runs and launch logs there (default: a temporary directory)"
    )
    ap.add_argument(
        "--report", action="store_true", help="only rewrite the .md and .png from the --out directory's .json"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, case)
        return
    out = Path(a.out)
    if a.report:
        res = json.loads((out / "cp_length_cpu.json").read_text())
        (out / "cp_length_cpu.md").write_text(case.report(res))
        case.plot(res, out / "cp_length_cpu.png")
        return
    from tqdm import tqdm

    names = a.runs.split(",")
    bad = [n for n in names if n not in case.runs]
    if bad or names[0] != "cp1":
        raise SystemExit(f"--runs {a.runs!r}: names of {', '.join(case.runs)}, cp1 first (the reference)")
    t0, load0 = time.perf_counter(), os.getloadavg()
    budget = int(a.budget_mib * 2**20)
    out.mkdir(parents=True, exist_ok=True)

    def write(rows: list, failures: list, done: list) -> dict:
        """The results so far (after each configuration: a run cut short keeps the configurations it finished)."""
        res = {
            "command": command(),
            "model": case.config,
            "budget_bytes": budget,
            "base": a.base,
            "cap": a.cap,
            "bisect_steps": case.bisect,
            "round": ROUND,
            "measured_step": case.measured_step + 1,
            "flags": case.flags,
            "phases": list(case.phases),
            "budget_excludes": list(case.budget_excludes),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "load": [load0[0], os.getloadavg()[0]],
            "minutes": (time.perf_counter() - t0) / 60,
            "runs_asked": names,
            "limits": limits(rows, done, a.cap),
            "parity": parity(rows),
            "rows": rows,
            "failed_launches": failures,
        }
        (out / "cp_length_cpu.json").write_text(json.dumps(res, indent=1) + "\n")
        return res

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model, _ = make_case(root, config_updates=case.config, rows=[])
        spec = {"root": str(root), "model": model, "budget_bytes": budget, "base": a.base, "cap": a.cap, "also": []}
        rows, failures = [], []
        with tqdm(total=None, desc=f"{case.recipe} cp length", unit="run") as bar:
            for i, n in enumerate(names):
                rows += search(case, n, spec, root, bar, failures)
                if n == "cp1" and case.rerun_cp1_fits:
                    spec["also"] = sorted(r["length"] for r in rows if r["fits"])
                res = write(rows, failures, names[: i + 1])
    md = case.report(res)
    (out / "cp_length_cpu.md").write_text(md)
    case.plot(res, out / "cp_length_cpu.png")
    print(md)
    bad = [p for p in res["parity"] if p["max_rel_diff"] > TOL]
    assert not bad, f"not the same training as cp1: {bad}"
