"""The markdown table and the plot of benchmarks/strategies/communication.py, from its measurements.

write_report(meta, results, out_dir)     # -> out_dir/communication_<device>.md / .png
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.strategies.comm_theory import EP_FSDP2, EXPERTS, MODEL, SEQ, TOP_K, TP

# Why measured / theory > 1.05, for the rows where that happens (from the measured collectives; the
# markdown prints the line only for rows over the threshold, and says so when a row has no entry).
WHY = {
    "zero1": "DeepSpeed's ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, v{ds}) never calls a reduce-scatter: "
    "with the defaults `reduce_scatter: true` and `use_multi_rank_bucket_allreduce: true`, "
    '`average_tensor` puts every gradient slice into one ("allreduce", dp group) bucket and '
    "`allreduce_and_scatter` -> `allreduce_bucket` calls `dist.all_reduce` on the whole bucket, then "
    "keeps this rank's partition: 2 Phi (N-1)/N (measured all_reduce) instead of Phi (N-1)/N; the "
    "parameter all-gather after the step matches theory. No DeepSpeed setting makes stage 1/2 call a "
    "reduce-scatter collective; `zero_optimization.use_multi_rank_bucket_allreduce: false` (a DeepSpeed "
    "JSON key, not one of Accelerate's yaml keys) sends each partition's slice to its owner with "
    "`dist.reduce` instead (checked once by hand with ZeRO-2, N=2: no gradient all-reduce, two "
    "`dist.reduce` per step whose payloads sum to Phi), which is the Phi (N-1)/N of the ZeRO paper "
    "with a bandwidth-optimal reduce. hfpar keeps DeepSpeed's default, which DeepSpeed's docs prefer "
    "for small models on many GPUs.",
}
WHY["zero2"] = WHY["zero1"]


def write_report(meta: dict, results: list[dict], out_dir: Path) -> None:
    """The markdown table and the plot, from what main() measured (or a saved JSON: --render)."""
    dev, phi, moe, nprocs, skipped = (meta[k] for k in ("device", "phi_bytes", "moe_phi_bytes", "nprocs", "skipped"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mb = 1 / 2**20
    lines = [
        f"# Communication per optimizer step and bytes held per rank ({dev})",
        "",
        f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}. "
        f"Llama hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}: "
        f"Phi = {phi * mb:.2f} MiB of fp32 parameters; global batch {meta['global_batch']} x {SEQ} tokens (packed), "
        "accumulation 1; medians of steps 2-4, rank 0. Wire bytes = what this rank sends with ring algorithms. "
        f"tp_ddp / tp_fsdp2: tp = {TP}, dp = N / {TP}. ep / ep_fsdp2: `--upcycle_experts {EXPERTS} "
        f"--moe_top_k {TOP_K}`"
        + (f" (Phi_dense = {moe['dense'] * mb:.2f} MiB, Phi_expert = {moe['expert'] * mb:.2f} MiB)" if moe else "")
        + f", ep = N (ep), {EP_FSDP2} (ep_fsdp2). Theory formulas: the docstring of "
        "benchmarks/strategies/communication.py. "
        "tokens/s: median of steps 2-4 of one run with the byte counter on, indicative only ("
        + (
            f"{max(nprocs)} processes share {meta['cpus']} CPUs here, so not scaling numbers; "
            if dev == "cpu" and (meta["cpus"] or 1) < max(nprocs)
            else ""
        )
        + "benchmarks/strategies/speed.py measures throughput); peak mem: largest per-rank peak "
        + ("allocated CUDA memory." if dev != "cpu" else "RSS of the process."),
        "",
        "| strategy | N | measured MiB/step (by collective) | theory MiB/step | measured / theory "
        "| tokens/s | peak mem / rank MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["measured"].items() if v > 1024)
        t = ", ".join(f"{k} {v * mb:.2f}" for k, v in r["theory"].items() if v > 0)
        lines.append(
            f"| {r['strategy']} | {r['n']} | {m} | {t} | {r['ratio']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{max(r['peak_mem_bytes_per_rank']) * mb:.0f} |"
        )
    over = [r for r in results if r["ratio"] > 1.05]
    if over:
        lines += ["", "Rows with measured / theory > 1.05:", ""]
        groups: dict[str, list[str]] = {}
        for r in over:
            excess = ", ".join(
                f"{k} {(r['measured'].get(k, 0) - r['theory'].get(k, 0)) * mb:+.2f} MiB"
                for k in sorted(set(r["measured"]) | set(r["theory"]))
                if abs(r["measured"].get(k, 0) - r["theory"].get(k, 0)) > 1024
            )
            why = WHY.get(r["strategy"], "not explained by this harness; see the excess by collective.")
            groups.setdefault(why, []).append(f"{r['strategy']} N={r['n']} ({r['ratio']:.3f}; {excess})")
        for why, rows in groups.items():
            lines.append("- **" + "; ".join(rows) + "**. Why: " + why.format(ds=meta["deepspeed"]))
    moe_rows = [r for r in results if "moe" in r]
    if moe_rows:
        lines += [
            "",
            "MoE all-to-all, rank 0 (rows = token copies of H floats, summed over "
            f"{MODEL['num_hidden_layers']} MoE layers, counted by MoELayer, not by the comm counter; routing "
            "changes every step, so each step's rows go with that step's bytes: the step shown is the one "
            "with the median routed-token minimum, which is the theory in the table above). Routed-token "
            "minimum = 2 x (routed + received) x H x 4 bytes (dispatch + combine, forward and backward); "
            "measured - minimum = the per-expert count exchange. Uniform = what uniform routing would send: "
            "4 x layers x tokens/rank x top_k x (ep-1)/ep rows x H x 4 bytes:",
            "",
            "| strategy | N | ep | step | rows routed to other ranks | rows received | all_to_all measured "
            "bytes | routed-token minimum bytes | measured / minimum | uniform routing bytes | measured / uniform |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in moe_rows:
            mo = r["moe"]
            a2a = mo["all_to_all_wire"]
            lines.append(
                f"| {r['strategy']} | {r['n']} | {r['ep']} | {mo['median_step']} | {mo['routed']} | "
                f"{mo['received']} | {a2a:.0f} | {mo['routed_min_bytes']:.0f} | "
                f"{a2a / mo['routed_min_bytes']:.5f} | {mo['uniform_bytes']:.0f} | "
                f"{a2a / mo['uniform_bytes']:.3f} |"
            )
    lines += [
        "",
        "Bytes held per rank vs theory (single-process bytes, / N where the strategy shards them; tp_ddp / "
        "tp_fsdp2: the `tp` run's per-rank bytes at the same tp, / dp under FSDP2; ep / ep_fsdp2: the "
        "single-process upcycled run x (Phi_dense [/ N under FSDP2] + Phi_expert / ep) / Phi); worst rank's "
        "ratio, — where no expectation is defined:",
        "",
        "| strategy | N | params | grads | optimizer state |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        h = r["held"]
        cells = []
        for c in ("params", "grads", "optimizer"):
            ratio = "—" if h[c]["max_ratio"] is None else f"{h[c]['max_ratio']:.3f}"
            cells.append(f"{h[c]['per_rank'][0] * mb:.2f} MiB ({ratio})")
        lines.append(f"| {r['strategy']} | {r['n']} | " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{x['strategy']} at N={x['n']}: {x['reason']}" for x in skipped) + "."]
    (out_dir / f"communication_{dev}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(max(9, 0.75 * len(results)), 4.2))
    labels = [f"{r['strategy']}\nN={r['n']}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [sum(r["measured"].values()) * mb for r in results], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [sum(r["theory"].values()) * mb for r in results], 0.4, label="theory")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("MiB sent per rank per step")
    ax.legend()
    ax.set_title("hfpar: communication per optimizer step, measured vs theory")
    fig.tight_layout()
    fig.savefig(out_dir / f"communication_{dev}.png", dpi=120)
