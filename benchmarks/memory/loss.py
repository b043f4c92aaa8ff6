"""Peak memory and speed of the LM head + cross-entropy: hfpar's chunked loss against the unchunked logits path.

    python -m benchmarks.memory.loss          # writes benchmarks/results/memory/loss_cpu.{json,md,png}

For each vocabulary V and token count N: hidden states (N, H) and an LM head (V, H) in fp32, one forward +
backward of the summed cross-entropy (5% of the targets ignored), either
  unchunked   F.linear -> F.cross_entropy (what transformers' loss and hfpar's --loss_chunk_size 0 do)
  chunked     hfpar.parallel.chunked_loss.chunked_linear_cross_entropy with the default chunk (~64M logits)
each case in a fresh process: peak resident memory above the inputs (ru_maxrss after building them), and the
median seconds of 3 timed repetitions after a warm-up; the modes alternate so that machine load falls on both.
CPU has no allocator statistics, hence RSS; the inputs, the weight and its gradient are common to both modes.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common.launch import ROOT, module_cmd, results_dir
from hfpar.observe.plot import human_bytes
from hfpar.parallel.chunked_loss import chunked_linear_cross_entropy

RESULTS = results_dir("memory")

H = 128
CASES = ((32_000, 4096), (32_000, 8192), (128_256, 4096), (128_256, 8192), (151_936, 4096))  # (V, N); the
# unchunked 152k x 8k case needs ~15 GB, more than a 24 GB CI machine can spare next to other work


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def one_case(mode: str, v: int, n: int) -> dict:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, H, generator=g).requires_grad_()
    w = (torch.randn(v, H, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::20] = -100
    w.grad = torch.zeros_like(w)  # the weight's gradient exists in both modes
    h.grad = torch.zeros_like(h)
    base = _peak_bytes()

    def step():
        if mode == "chunked":
            loss = chunked_linear_cross_entropy(h, w, None, t)
        else:
            loss = F.cross_entropy(F.linear(h, w), t, ignore_index=-100, reduction="sum")
        loss.backward()
        return loss.item()

    loss = step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "mode": mode,
        "vocab": v,
        "tokens": n,
        "loss": loss,
        "peak_bytes": _peak_bytes() - base,
        "s": statistics.median(times),
        "tokens_per_s": n / statistics.median(times),
    }


def run(mode: str, v: int, n: int) -> dict:
    out = subprocess.run(
        module_cmd("benchmarks.memory.loss", "--case", mode, v, n), cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def draw(ax, rows: list[dict]) -> None:
    """Peak memory per (vocab, tokens) case, unchunked next to chunked; a case without an unchunked row (too big
    for the machine, benchmarks/memory/host.py) has the chunked bar only."""
    cases = list(dict.fromkeys((r["vocab"], r["tokens"]) for r in rows))
    for off, mode in ((-0.2, "unchunked"), (0.2, "chunked")):
        got = {(r["vocab"], r["tokens"]): r["peak_bytes"] / 2**30 for r in rows if r["mode"] == mode}
        ax.bar(
            [i + off for i, c in enumerate(cases) if c in got],
            [got[c] for c in cases if c in got],
            width=0.4,
            label=mode,
        )
    ax.set_xticks(range(len(cases)), [f"V={v // 1000}k\nN={n}" for v, n in cases], fontsize=8)
    ax.set_ylabel("peak memory above inputs (GiB)")
    ax.set_title(f"LM head + cross-entropy, fp32, hidden {H} (CPU RSS)")
    ax.legend()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax, rows)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(one_case(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    rows = []
    for v, n in CASES:
        order = ("unchunked", "chunked") if len(rows) % 4 == 0 else ("chunked", "unchunked")
        pair = {mode: run(mode, v, n) for mode in order}
        rows += [pair["unchunked"], pair["chunked"]]
        print(json.dumps(pair), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loss_cpu.json").write_text(json.dumps({"hidden": H, "rows": rows}, indent=2))
    lines = [
        "# LM head + cross-entropy: chunked vs unchunked (CPU, fp32)",
        "",
        f"`python -m benchmarks.memory.loss`: hidden {H}, forward + backward of the summed loss, peak RSS "
        "above the inputs, median of 3 timed repetitions, each case in a fresh process.",
        "",
        "| vocab | tokens | unchunked peak | chunked peak | ratio | unchunked tok/s | chunked tok/s | speed ratio |"
        " loss rel diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for u, c in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {u['vocab']} | {u['tokens']} | {human_bytes(u['peak_bytes'])} | {human_bytes(c['peak_bytes'])}"
            f" | {c['peak_bytes'] / u['peak_bytes']:.2f} | {u['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} |"
            f" {c['tokens_per_s'] / u['tokens_per_s']:.2f} | {abs(c['loss'] - u['loss']) / u['loss']:.1e} |"
        )
    (RESULTS / "loss_cpu.md").write_text("\n".join(lines) + "\n")
    plot(rows, RESULTS / "loss_cpu.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
