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
import random
import string
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, results_dir
from benchmarks.dpo.trl_compare import _reset_accelerate, make_case
from hfpar.observe.plot import human_bytes

RESULTS = results_dir("dpo")
CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1 << 16,
}
RUNS = {
    "cp1": ("single", 1, []),
    "cp2_ring": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ring"]),
    "cp4_ring": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ring"]),
    "cp2_ulysses": ("ddp", 2, ["--cp_size", "2", "--cp_mode", "ulysses"]),
    "cp4_ulysses": ("ddp", 4, ["--cp_size", "4", "--cp_mode", "ulysses"]),
}
FLAGS = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "1",
    "--gradient_accumulation_steps",
    "1",
    "--learning_rate",
    "1e-3",
    "--lr_scheduler_type",
    "constant",
    "--max_grad_norm",
    "1.0",
    "--beta",
    "0.1",
    "--eval_steps",
    "0",
    "--save_final_model",
    "false",
    "--logging_steps",
    "1",
    "--max_length",
    "65536",
    "--max_seq_length",
    "65536",
]
MEASURED_STEP = 1  # the second step (0-based): the model, reference and optimizer state exist at its start
BISECT, ROUND = 3, 16
TOL = 1e-4


# ------------------------------------------------------------------------------------------------ data
def pairs(length: int, n: int = 2, seed: int = 0) -> list[dict]:
    """n standard-format pairs of `length` tokens (prompt + chosen + rejected) for the embedded character tokenizer:
    the prompt L/4 tokens with its bos, each completion (L - L/4)/2 with the eos the tokenization appends."""
    rng = random.Random(seed + length)
    prompt_n = length // 4
    chosen_n = (length - prompt_n) // 2
    rejected_n = length - prompt_n - chosen_n

    def text(k: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase + "     ") for _ in range(k))

    return [
        {"prompt": text(prompt_n - 1), "chosen": text(chosen_n - 1), "rejected": text(rejected_n - 1)} for _ in range(n)
    ]


def data_file(root: Path, length: int) -> str:
    """The pairs of `length` as JSON Lines under root (every rank writes the same bytes: replaced atomically)."""
    path = root / f"pairs_{length}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in pairs(length)))
        os.replace(tmp, path)
    return str(path)


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

    def measured(self, i, micro):
        if i != MEASURED_STEP:
            rec = step(self, i, micro)
        else:
            rec, peak, rss = _measure(lambda: step(self, i, micro))
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


def limits(rows: list[dict], names: list[str], cap: int) -> dict:
    """Per configuration: the longest length that fits, the shortest measured one that does not."""
    out = {}
    for n in names:
        mine = [r for r in rows if r["run"] == n]
        fit = [r["length"] for r in mine if r["fits"]]
        over = [r["length"] for r in mine if not r["fits"] and r["length"] > max(fit, default=0)]
        out[n] = {
            "longest_fit": max(fit, default=None),
            "shortest_over": min(over, default=None),
            "capped": not over and max(fit, default=0) * 2 > cap,
        }
    return out


def parity(rows: list[dict]) -> list[dict]:
    """Every (configuration, length) that cp1 ran too: the largest relative difference of the losses and grad
    norms of its steps."""
    base = {r["length"]: r for r in rows if r["run"] == "cp1"}
    out = []
    for r in rows:
        b = base.get(r["length"])
        if r["run"] == "cp1" or b is None:
            continue
        diff = max(abs(x - y) / max(abs(y), 1e-12) for k in ("losses", "grad_norms") for x, y in zip(r[k], b[k]))
        out.append({"run": r["run"], "length": r["length"], "max_rel_diff": diff, "both_fit": r["fits"] and b["fits"]})
    return out


def row_width(r: dict) -> int:
    """Tokens of a run's row: cp1 shares the prompt (L + 1), CP rows hold it twice (the recipe's token count,
    row_tokens), padded to a multiple of 2 cp."""
    cp = RUNS[r["run"]][1]
    return r["length"] + 1 if cp == 1 else -(-r["row_tokens"] // (2 * cp)) * 2 * cp


def report(res: dict) -> str:
    mib = res["budget_bytes"] / 2**20
    md = [
        "# DPO under context parallelism: per-rank step memory against pair length (CPU, gloo, fp32)",
        "",
        (
            f"`{res['command']}`; {res['date']}, {res['cpus']} CPUs, load average {res['load'][0]:.1f} at the start, "
            f"{res['load'][1]:.1f} at the end; {res['minutes']:.1f} min. Model: Llama {res['model']}. Per rank, the "
            "second optimizer step's peak of live tensor bytes above those live at its start (torch.profiler memory "
            "events: activations, gradients, the reference forward, collation); largest over the ranks. Pair length "
            "= prompt + chosen + rejected tokens (L/4, 3L/8, 3L/8); row = the width of its row: cp1 L + 1 (prompt + "
            "chosen | the prompt's last token + rejected, a block mask), under CP 5L/4 (prompt + chosen | prompt + "
            "rejected, padded to a multiple of 2 cp)."
        ),
        "",
        (
            f"Budget: **{mib:.0f} MiB per rank**. Longest pair that trains within it (doubling from {res['base']}, "
            "then "
            f"{BISECT} bisection steps, lengths rounded to {ROUND} tokens):"
        ),
        "",
        "| configuration | processes | longest pair within budget | first over budget | vs cp1 |",
        "|---|---|---|---|---|",
    ]
    base = res["limits"].get("cp1", {}).get("longest_fit")
    for n, lim in res["limits"].items():
        f = lim["longest_fit"]
        md.append(
            f"| {n} | {RUNS[n][1]} | {f if f else 'none'}{' (cap)' if lim['capped'] else ''} | "
            f"{lim['shortest_over'] or ''} | {f / base:.2f}x |"
            if f and base
            else f"| {n} | {RUNS[n][1]} | {f or 'none'} | {lim['shortest_over'] or ''} | |"
        )
    md += [
        "",
        "Memory against length (every run; `*` over budget):",
        "",
        (
            "| configuration | pair tokens | row tokens | step peak (tensors) | RSS high-water growth | step s |"
            " losses (step 1, 2) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(res["rows"], key=lambda r: (list(RUNS).index(r["run"]), r["length"])):
        md.append(
            f"| {r['run']} | {r['length']} | {row_width(r)} | {human_bytes(r['peak_bytes'])}"
            f"{'' if r['fits'] else ' *'} | {human_bytes(r['rss_peak_bytes'])} | "
            f"{' / '.join(f'{t:.1f}' for t in r['step_time_s'])} | "
            f"{' / '.join(f'{x:.6f}' for x in r['losses'])} |"
        )
    p = res["parity"]
    worst = max((x["max_rel_diff"] for x in p), default=0.0)
    md += [
        "",
        (
            f"Same training: {len(p)} (configuration, length) runs against cp1's at the same length (losses and grad "
            f"norms of both steps): largest relative difference {worst:.1e} (tolerance {TOL:g})."
        ),
    ]
    for f in res["failed_launches"]:
        md.append(
            f"\nLaunch {f['attempt']} of {f['run']} failed after lengths {f['lengths_done']} and was launched "
            f"again, those lengths kept: `{f['error'][-200:]}`"
        )
    return "\n".join(md) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib  # an optional extra, for the plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"cp1": "k-o", "cp2_ring": "b-o", "cp4_ring": "g-o", "cp2_ulysses": "c--s", "cp4_ulysses": "y--s"}
    for n in res["limits"]:
        pts = sorted((r["length"], r["peak_bytes"] / 2**20) for r in res["rows"] if r["run"] == n)
        ax.plot(*zip(*pts), styles[n], label=n.replace("_", " "), ms=4)
    ax.axhline(res["budget_bytes"] / 2**20, color="r", lw=1, ls=":", label="budget")
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="pair length (prompt + chosen + rejected tokens)",
        ylabel="per-rank step peak above its start (MiB)",
        title="DPO step memory per rank vs pair length (CPU, fp32)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
