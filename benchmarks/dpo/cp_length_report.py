"""benchmarks/dpo/cp_length.py's results as text and a plot: the longest pair each run trained, their parity.

From the JSON cp_length.py writes (res):
    print(report(res)); plot(res, path)
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common.cp_length_report import limits_table, parity_lines
from benchmarks.common.cp_length_report import plot as plot_lengths
from benchmarks.dpo.cp_length_spec import RUNS
from hfpar.observe.plot import human_bytes


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
            f"{res['bisect_steps']} bisection steps, lengths rounded to {res.get('round', 16)} tokens):"
        ),
        "",
    ]
    md += limits_table(res, RUNS, "pair")
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
    md += parity_lines(res)
    return "\n".join(md) + "\n"


def plot(res: dict, path: Path) -> None:
    plot_lengths(
        res,
        path,
        {"cp1": "k-o", "cp2_ring": "b-o", "cp4_ring": "g-o", "cp2_ulysses": "c--s", "cp4_ulysses": "y--s"},
        xlabel="pair length (prompt + chosen + rejected tokens)",
        title="DPO step memory per rank vs pair length (CPU, fp32)",
    )
