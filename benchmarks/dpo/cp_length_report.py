"""benchmarks/dpo/cp_length.py's results as text and a plot: the longest pair each run trained, their parity.

From the JSON cp_length.py writes (res):
    print(report(res)); plot(res, path)
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.dpo.cp_length_spec import BISECT, ROUND, RUNS, TOL
from hfpar.observe.plot import human_bytes


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
