"""benchmarks/grpo/cp_length.py's results as text and a plot: the longest group each configuration trained within the
budget, the training, generation and log-prob peaks apart, chunked against full logits, the parity with cp1.

From the JSON cp_length.py writes (res):
    print(report(res)); plot(res, path)
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common.cp_length_report import limits_table, parity_lines
from benchmarks.common.cp_length_report import plot as plot_lengths
from benchmarks.grpo.cp_length_spec import CHUNK, GROUP, RUNS, split
from hfpar.observe.plot import human_bytes


def _at(res: dict, run: str, length: int) -> dict | None:
    return next((r for r in res["rows"] if r["run"] == run and r["length"] == length), None)


def _chunked_vs_full(res: dict) -> list[str]:
    """cp1 and cp1_full_logits at the longest length both ran."""
    both = sorted(
        {r["length"] for r in res["rows"] if r["run"] == "cp1"}
        & {r["length"] for r in res["rows"] if r["run"] == "cp1_full_logits"}
    )
    if not both:
        return []
    a, b = _at(res, "cp1", both[-1]), _at(res, "cp1_full_logits", both[-1])
    return [
        "",
        (
            f"Chunked against full logits (cp1, group length {both[-1]}, {GROUP * split(both[-1])[1]} completion "
            f"targets, vocabulary {res['model'].get('vocab_size')}): training peak {human_bytes(a['peak_bytes'])} "
            f"with the log-probs computed {CHUNK} targets at a time (`--loss_chunk_size {CHUNK}`), "
            f"{human_bytes(b['peak_bytes'])} with the targets' (N, V) logits (`--loss_chunk_size 0`): "
            f"{b['peak_bytes'] / a['peak_bytes']:.2f}x."
        ),
    ]


def _generation(res: dict) -> list[str]:
    """The generation's peak at each configuration's longest length within budget: it does not shrink with cp."""
    out = []
    for n, lim in res["limits"].items():
        r = _at(res, n, lim["longest_fit"]) if lim["longest_fit"] else None
        if r is not None:
            out.append(
                f"{n} {human_bytes(r['generation_bytes'])} at {r['length']} (training {human_bytes(r['peak_bytes'])})"
            )
    cp_runs = [n for n in res["limits"] if n != "cp1_full_logits"]
    shared = set.intersection(*({r["length"] for r in res["rows"] if r["run"] == n} for n in cp_runs))
    if shared:
        at = max(shared)
        peaks = {n: human_bytes(_at(res, n, at)["generation_bytes"]) for n in cp_runs}
        out.append(f"at L = {at}, which every one of {', '.join(cp_runs)} ran: {', '.join(peaks.values())}")
    return [
        "",
        (
            "Generation is not cut by context parallelism: every rank of a replica generates its whole rows "
            "(hfpar.parallel.context_parallel.whole_sequence; KV cache of prompt + completion, fp32), so its peak "
            "grows with the group's whole length whatever cp is, and it is measured apart (the `generation` span of "
            "the step) and not counted in the budget. Its peak above its start at each configuration's longest group: "
            + "; ".join(out)
            + "."
        ),
    ]


def report(res: dict) -> str:
    mib = res["budget_bytes"] / 2**20
    md = [
        "# GRPO under context parallelism: per-rank training memory against group length (CPU, gloo, fp32)",
        "",
        (
            f"`{res['command']}`; {res['date']}, {res['cpus']} CPUs, load average {res['load'][0]:.1f} at the start, "
            f"{res['load'][1]:.1f} at the end; {res['minutes']:.1f} min. Model: Llama {res['model']} (random init; "
            "the embedded 128-token character tokenizer, the vocabulary padded to 8192 rows so that the head weighs "
            f"as a real model's). A group of length L: {GROUP} completions of one prompt, the prompt L/8 tokens, each "
            'completion exactly 7L/8 (`--max_completion_length 7L/8 --generation_kwargs \'{"min_new_tokens": '
            "7L/8}'`: EOS masked until then). 3 optimizer steps, `--num_iterations 2 --beta 0.04`: step 3 "
            "generates the second window, computes its old and reference log-probs and trains on it; it is the "
            "step measured. Per rank, torch.profiler memory events: peaks of live tensor bytes above those live at "
            "the step's start; largest over the ranks. **training** = the step outside the generation (old and "
            "reference log-probs, policy forward / backward over the prompt + completion rows cut over the cp "
            "ranks, clipping, the optimizer step): the budget counts it; **generation** and **log-probs**: each "
            "phase's peak above the live bytes at its start; **step** = the whole step's."
        ),
        "",
        (
            f"Budget: **{mib:.0f} MiB of training memory per rank**. Longest group that trains within it (doubling "
            f"from {res['base']}, then {res['bisect_steps']} bisection steps, lengths rounded to {res['round']} "
            "tokens):"
        ),
        "",
    ]
    md += limits_table(res, RUNS, "group (prompt + completion tokens)")
    md += _chunked_vs_full(res)
    md += _generation(res)
    md += [
        "",
        "Memory against length (every run; `*` training over budget):",
        "",
        (
            "| configuration | group length L | completion tokens (mean) | training | generation | log-probs | "
            "step | RSS high-water growth | step s | losses (steps 1-3) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(res["rows"], key=lambda r: (list(RUNS).index(r["run"]), r["length"])):
        lengths = [x for x in r.get("completions/mean_length", []) if x is not None]
        md.append(
            f"| {r['run']} | {r['length']} | {lengths[-1] if lengths else ''} | {human_bytes(r['peak_bytes'])}"
            f"{'' if r['fits'] else ' *'} | {human_bytes(r['generation_bytes'])} | {human_bytes(r['logps_bytes'])} | "
            f"{human_bytes(r['step_peak_bytes'])} | {human_bytes(r['rss_peak_bytes'])} | "
            f"{' / '.join(f'{t:.1f}' for t in r['step_time_s'])} | {' / '.join(f'{x:.6f}' for x in r['losses'])} |"
        )
    md += parity_lines(res)
    return "\n".join(md) + "\n"


def plot(res: dict, path: Path) -> None:
    def generation(ax):
        pts = sorted((r["length"], r["generation_bytes"] / 2**20) for r in res["rows"])
        ax.plot(*zip(*pts), "x", color="0.5", ms=5, label="generation (any cp)")

    plot_lengths(
        res,
        path,
        {
            "cp1": "k-o",
            "cp1_full_logits": "m-.^",
            "cp2_ring": "b-o",
            "cp4_ring": "g-o",
            "cp2_ulysses": "c--s",
            "cp4_ulysses": "y--s",
        },
        xlabel="group length L (prompt + completion tokens; 4 completions)",
        title="GRPO training memory per rank vs group length (CPU, fp32)",
        extra=generation,
    )
