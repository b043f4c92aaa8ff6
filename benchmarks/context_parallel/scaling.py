"""Context parallelism: activation memory per rank against sequence length, the longest sequence within a memory
budget, communication bytes against theory (ring and Ulysses), and tokens/s, at cp = 1, 2, 4.

    python -m benchmarks.context_parallel.scaling          # writes results/context_parallel/scaling_cpu.{json,md,png}
    python -m benchmarks.context_parallel.scaling attention [T ...] [--cp 1,2,4]   # attention alone (attention.py):
                                                   # benchmarks/results/context_parallel/attention_cpu.{json,md,png}
    python -m benchmarks.context_parallel.scaling recipe [T ...]      # recipe tokens/s at cp = 1, 2, 4 (recipe.py):
                                                   # benchmarks/results/context_parallel/recipe_cpu.{json,md,png}

Activation memory is measured exactly, as tensor_parallel/activation_memory.py does: the bytes of every tensor autograd
saves for
backward during one forward (saved_tensors_hooks; parameters excluded), on rank 0, for a Llama-style model (hidden
256, 4 layers, 8 heads, 4 kv heads, fp32), one row of T tokens cut over cp gloo ranks on CPU; cp=1 is the stock
model (transformers' SDPA with its own causal mask, nothing T x T kept), the baseline. Communication: the
bytes each rank puts on the wire during one forward + backward, counted by hfpar's CommCounter (the
--log_comm_bytes counter), against the formula for each mechanism:
(the committed table predates the overlapped ring: its ring rows are the all-gather form; CommCounter counts the
overlapped ring's batched isend / irecv as "send", tests/distributed/test_comm_stats.py)
    ring (all-gather form,  per layer 2 all-gathers (K, V) forward, 2 again in backward (K and V are not kept) and
    the committed table)    2 reduce-scatters (dK, dV) of B x Hkv x T x D values:
                            wire = 6 x B x Hkv x T x D x 4 bytes x (cp - 1) / cp
    ring (overlapped, what  per layer (4 (cp - 1) + 2 cp) sends of B x Hkv x T/cp x D values:
    this script measures)   wire = (4 (cp - 1) + 2 cp) x B x Hkv x T/cp x D x 4 bytes
    ulysses                 per layer 4 all-to-alls forward (q, k, v, out) + 4 backward of the local
                            B x (H or Hkv) x T/cp x D values (kv heads repeated to H when not divisible by cp):
                            wire = 2 x (2 H + 2 Hkv') x B x T/cp x D x 4 bytes x (cp - 1) / cp
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common.activation_bytes import saved_tensor_bytes
from benchmarks.common.launch import results_dir, run_ranks
from benchmarks.context_parallel import attention as cp_attention
from benchmarks.context_parallel import recipe as cp_recipe
from hfpar.observe.comm_stats import CommCounter
from hfpar.parallel.context_parallel import cp_rows, register_cp_attention, shard_batch, shift_labels

RESULTS = results_dir("context_parallel")

LENGTHS = (1024, 2048, 4096, 8192)
CFG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=16384,
    use_cache=False,
)


def _model(cp: bool):
    """cp=False: the stock model (transformers' SDPA, causal, no mask kept): the baseline without CP."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    model.set_attn_implementation("sdpa")
    if cp:
        model.set_attn_implementation(register_cp_attention())
    return model


def _measure(rank: int, world: int, mode: str, seq_len: int) -> dict:
    model = _model(cp=world > 1)
    ids = torch.randint(0, 512, (1, seq_len), generator=torch.Generator().manual_seed(1))
    batch = shift_labels({"input_ids": ids, "labels": ids.clone()})
    local, rows = shard_batch(batch, rank, world)
    group = dist.group.WORLD if dist.is_initialized() else None
    counter = CommCounter().install() if world > 1 else None
    t0 = time.perf_counter()
    with cp_rows(rows, group, mode):
        saved, logits = saved_tensor_bytes(
            model, lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        )
    with cp_rows(rows, group, mode):
        logits.float().square().mean().backward()
    dt = time.perf_counter() - t0
    wire = counter.wire_total() if counter is not None else 0.0
    if counter is not None:
        counter.uninstall()
    return {"saved_bytes": saved, "wire_bytes": wire, "seconds": dt, "tokens_per_s": seq_len / dt}


def theory_wire(mode: str, cp: int, seq_len: int) -> float:
    if cp == 1:
        return 0.0
    d = CFG["hidden_size"] // CFG["num_attention_heads"]
    layers, h, hkv = CFG["num_hidden_layers"], CFG["num_attention_heads"], CFG["num_key_value_heads"]
    if mode == "ring":  # the overlapped ring (the default): K, V (cp-1) x forward; K, V (cp-1) x, dK, dV cp x backward
        return layers * (4 * (cp - 1) + 2 * cp) * hkv * (seq_len // cp) * d * 4
    kv = hkv if hkv % cp == 0 else h  # kv heads repeated when fewer than cp
    return layers * 2 * (2 * h + 2 * kv) * (seq_len // cp) * d * 4 * (cp - 1) / cp


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq_len in LENGTHS:
        one = _measure(0, 1, "ring", seq_len)
        rows.append({"seq_len": seq_len, "cp": 1, "mode": "-", **one, "theory_wire_bytes": 0.0})
        for cp in (2, 4):
            for mode in ("ring", "ulysses"):
                r = run_ranks(_measure, cp, mode, seq_len, timeout=1800)[0]
                rows.append(
                    {
                        "seq_len": seq_len,
                        "cp": cp,
                        "mode": mode,
                        **r,
                        "theory_wire_bytes": theory_wire(mode, cp, seq_len),
                    }
                )
                print(rows[-1], flush=True)
    longest = rows[-1]["seq_len"]
    base = {r["seq_len"]: r["saved_bytes"] for r in rows if r["cp"] == 1}
    budget = base[LENGTHS[1]]  # the cp=1 activation bytes at 2k tokens
    fits = {
        f"cp{cp}_{m}": max(
            [r["seq_len"] for r in rows if r["cp"] == cp and r["mode"] == m and r["saved_bytes"] <= budget] or [0]
        )
        for cp, m in ((1, "-"), (2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses"))
    }
    (RESULTS / "scaling_cpu.json").write_text(
        json.dumps({"rows": rows, "budget_bytes": budget, "longest_within_budget": fits}, indent=2)
    )
    md = [
        "# Context parallelism (CPU, gloo, fp32)",
        "",
        "Command: `python -m benchmarks.context_parallel.scaling` (Llama hidden 256, 4 layers, 8 heads / 4 kv heads, "
        "one row "
        "of T tokens; rank 0's numbers)",
        "",
        "| T | cp | mode | activation MB | vs cp=1 | wire MB | theory MB | wire / theory | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["wire_bytes"] / r["theory_wire_bytes"] if r["theory_wire_bytes"] else float("nan")
        md.append(
            f"| {r['seq_len']} | {r['cp']} | {r['mode']} | {r['saved_bytes'] / 1e6:.1f} | "
            f"{r['saved_bytes'] / base[r['seq_len']]:.2f} | {r['wire_bytes'] / 1e6:.1f} | "
            f"{r['theory_wire_bytes'] / 1e6:.1f} | {ratio:.3f} | {r['tokens_per_s']:.0f} |"
        )
    md += [
        "",
        f"Longest T (of {', '.join(map(str, LENGTHS))}) whose activations fit the cp=1 bytes at "
        f"{LENGTHS[1]} tokens ({budget / 1e6:.1f} MB): " + ", ".join(f"{k} {v}" for k, v in fits.items()) + ".",
        f"At T={longest}: activation bytes per rank cp=2 / cp=1 = "
        + ", ".join(
            f"{r['mode']} {r['saved_bytes'] / base[longest]:.2f}"
            for r in rows
            if r["seq_len"] == longest and r["cp"] == 2
        )
        + "; cp=4 / cp=1 = "
        + ", ".join(
            f"{r['mode']} {r['saved_bytes'] / base[longest]:.2f}"
            for r in rows
            if r["seq_len"] == longest and r["cp"] == 4
        )
        + ".",
    ]
    (RESULTS / "scaling_cpu.md").write_text("\n".join(md) + "\n")
    import matplotlib  # noqa: PLC0415  (an optional extra, for the plot only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for cp, m, style in (
        (1, "-", "k-o"),
        (2, "ring", "b-o"),
        (2, "ulysses", "b--s"),
        (4, "ring", "g-o"),
        (4, "ulysses", "g--s"),
    ):
        pts = [(r["seq_len"], r["saved_bytes"] / 1e6) for r in rows if r["cp"] == cp and r["mode"] == m]
        ax.plot(*zip(*pts), style, label=f"cp={cp}" + (f" {m}" if cp > 1 else ""))
    ax.axhline(budget / 1e6, color="gray", lw=0.8, ls=":", label="budget (cp=1 at 2k)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("MB saved for backward, rank 0")
    ax.set_title("context parallelism: activation memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling_cpu.png", dpi=110)
    print("\n".join(md))


def _write(module, stem: str, res: dict) -> None:
    """RESULTS/<stem>.{json,md,png} from a measurement and its module's report and plot."""
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2))
    md = module.report(res)
    (RESULTS / f"{stem}.md").write_text("\n".join(md) + "\n")
    module.plot(res, RESULTS / f"{stem}.png")
    print("\n".join(md))


def attention(lengths, cps) -> None:
    progress = RESULTS / "attention_cpu.partial.json"  # the rows so far, should a run die
    res = cp_attention.measure(lengths, cps, progress=progress)
    progress.unlink()
    _write(cp_attention, "attention_cpu", res)


def recipe(lengths) -> None:
    progress = RESULTS / "recipe_cpu.partial.json"  # the lengths so far, should a run die
    _write(cp_recipe, "recipe_cpu", cp_recipe.measure(lengths, progress=progress))
    progress.unlink()


if __name__ == "__main__":
    if sys.argv[1:2] == ["attention"]:  # attention [T ...] [--cp 1,2,4]
        argv = sys.argv[2:]
        cps = (1, 2, 4)
        if "--cp" in argv:
            i = argv.index("--cp")
            cps, argv = tuple(int(c) for c in argv[i + 1].split(",")), argv[:i] + argv[i + 2 :]
        attention([int(x) for x in argv] or [4096, 8192, 16384], cps)
    elif sys.argv[1:2] == ["recipe"]:
        recipe([int(x) for x in sys.argv[2:]] or [2048, 4096, 8192])
    else:
        main()
