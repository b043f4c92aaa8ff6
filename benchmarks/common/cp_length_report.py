"""The parts of the context-parallel length benchmarks' reports (benchmarks/{dpo,grpo}/cp_length_report.py) that
read the rows alike: the longest length each configuration trained within the budget, the same-training comparison
with cp1, the limits table, the parity line, and the plot of memory against length.

    lim = limits(rows, ["cp1", "cp2_ring"], cap=16384)   # {run: {longest_fit, shortest_over, capped}}
    par = parity(rows)                                   # [{run, length, max_rel_diff, both_fit}]
    md += limits_table(res, runs, "pair"); md += parity_lines(res)
    plot(res, path, styles, xlabel="pair length (...)", title="...")
"""

from __future__ import annotations

from pathlib import Path

TOL = 1e-4  # the parity contract's relative tolerance


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
    norms of its steps; a value near 0 (GRPO's loss at an importance ratio of 1: minus a mean advantage) relative to
    1e-2 of the largest of its kind in cp1's run, as tests/launch/test_grpo_parity.py does."""
    base = {r["length"]: r for r in rows if r["run"] == "cp1"}
    out = []
    for r in rows:
        b = base.get(r["length"])
        if r["run"] == "cp1" or b is None:
            continue
        diff = max(
            abs(x - y) / max(abs(y), 1e-2 * max(map(abs, b[k])), 1e-12)
            for k in ("losses", "grad_norms")
            for x, y in zip(r[k], b[k])
        )
        out.append({"run": r["run"], "length": r["length"], "max_rel_diff": diff, "both_fit": r["fits"] and b["fits"]})
    return out


def limits_table(res: dict, runs: dict, unit: str) -> list[str]:
    """The markdown table of the longest `unit` (e.g. "pair", "group") each configuration trained within budget."""
    md = [
        f"| configuration | processes | longest {unit} within budget | first over budget | vs cp1 |",
        "|---|---|---|---|---|",
    ]
    base = res["limits"].get("cp1", {}).get("longest_fit")
    for n, lim in res["limits"].items():
        f = lim["longest_fit"]
        md.append(
            f"| {n} | {runs[n][1]} | {f if f else 'none'}{' (cap)' if lim['capped'] else ''} | "
            f"{lim['shortest_over'] or ''} | {f / base:.2f}x |"
            if f and base
            else f"| {n} | {runs[n][1]} | {f or 'none'} | {lim['shortest_over'] or ''} | |"
        )
    return md


def parity_lines(res: dict) -> list[str]:
    """The same-training line (every configuration against cp1 at the same length) and any relaunched launches."""
    p = res["parity"]
    worst = max((x["max_rel_diff"] for x in p), default=0.0)
    md = [
        "",
        (
            f"Same training: {len(p)} (configuration, length) runs against cp1's at the same length (losses and grad "
            f"norms of every step): largest relative difference {worst:.1e} (tolerance {TOL:g})."
        ),
    ]
    missing = [n for n in res.get("runs_asked", []) if n not in res["limits"]]
    if missing:
        md.append(f"\nCut short before {', '.join(missing)} ran (the results are written after each configuration).")
    for f in res["failed_launches"]:
        md.append(
            f"\nLaunch {f['attempt']} of {f['run']} failed after lengths {f['lengths_done']} and was launched "
            f"again, those lengths kept: `{f['error'][-200:]}`"
        )
    return md


def plot(res: dict, path: Path, styles: dict, *, xlabel: str, title: str, key: str = "peak_bytes", extra=None) -> None:
    """Per configuration its `key` (MiB) against length, log2 x axis, the budget as a line; extra(ax): more on it."""
    import matplotlib  # an optional extra, for the plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in res["limits"]:
        pts = sorted((r["length"], r[key] / 2**20) for r in res["rows"] if r["run"] == n)
        ax.plot(*zip(*pts), styles[n], label=n.replace("_", " "), ms=4)
    if extra is not None:
        extra(ax)
    ax.axhline(res["budget_bytes"] / 2**20, color="r", lw=1, ls=":", label="budget")
    ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel="per-rank step peak above its start (MiB)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
