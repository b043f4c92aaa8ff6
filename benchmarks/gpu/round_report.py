"""The tables of a GPU round (benchmarks/gpu/round.sh's all.tgz, unpacked) from its raw outputs, with the figures
the raw files hold but the first scripts computed wrongly or not at all:

    python -m benchmarks.gpu.round_report DIR [DIR ...] --out benchmarks/results/gpu/round/round.md

- SFT (peers/): every variant trains the same rows in the same order, so a step's tokens are the same in all of them
  (TRL's log counts them: `num_tokens`, cumulative). Speed is taken over the steps after the warm-up at the median
  step time (peers.json `step_time_s`): tokens/s = mean tokens of those steps / median step time. Why not peers.py's
  own rate: its first timed steps still held recompilations of the compiled variants (packed rows vary in length),
  so its all-steps rate mixed compile time into the speed. Steps with a recompilation are listed.
- GPU busy (busy/): kernel time per step without the profiler's user annotations, which torch 2.11 reports as GPU
  events too (`hfpar::*` ranges and `Optimizer.step#...`: profile.py's first figure counted them and passed 100%).
- DPO (dpo/ of a later DIR may hold hfpar's chrome trace): busy = union of kernel / copy intervals over the span of
  the profiled steps.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import zlib
from pathlib import Path

from benchmarks.gpu.sft import peak_flops


def step_tokens(log: Path) -> list[int]:
    """Tokens of each step, from TRL's cumulative num_tokens."""
    cum = [int(float(x)) for x in re.findall(r"'num_tokens': '([0-9.e+]+)'", log.read_text())]
    return [b - a for a, b in zip([0, *cum], cum)]


def hfpar_rates(log: Path) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+/\d+ loss \S+ grad_norm \S+ lr \S+ tok/s (\d+)", log.read_text())]


def sft_table(peers: Path) -> list[str]:
    d = json.loads((peers / "peers.json").read_text())
    env, res = d["env"], {r["variant"]: r for r in d["results"]}
    trl_log = next((peers / "logs" / f"{v}.log" for v in ("trl", "trl_liger") if v in res), None)
    tokens = step_tokens(trl_log) if trl_log else []
    w = env["warmup"]
    mean_tok = statistics.mean(tokens[w:]) if tokens else None
    base = res["hfpar"]["losses"]
    lines = [
        f"SFT, {env['gpu']}, Llama-3.2-3B shape ({env['params'] / 1e9:.2f}B, tied), packed rows of <= {env['seq_len']} "
        f"tokens x {env['batch_size']} (mean {mean_tok:.0f} tokens / step over steps {w + 1}-{env['steps']}), "
        f"bf16 autocast over fp32 weights, AdamW; torch {env['torch']}.",
        "",
        "| variant | median step ms | tokens/s | MFU | peak GiB | compile s | steps recompiling | max rel. loss diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, r in res.items():
        if "error" in r:
            lines.append(f"| {v} | failed | | | | | | |")
            continue
        rate = mean_tok / r["step_time_s"]
        slow = ""
        if v.startswith("hfpar"):
            per = hfpar_rates(peers / "logs" / f"{v}.log")
            slow = ", ".join(str(i + 1) for i, x in enumerate(per) if i >= 1 and x < 0.2 * statistics.median(per))
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base))
        mfu = 100 * rate * env["flops_per_token"] / peak_flops(env["gpu"])
        lines.append(
            f"| {v} | {1e3 * r['step_time_s']:.0f} | {rate:,.0f} | {mfu:.1f}% | {r['peak_mem_bytes'] / 2**30:.1f} "
            f"| {r.get('compile_s') or ''} | {slow} | {diff:.1e} |"
        )
    ok = {v: r for v, r in res.items() if "error" not in r}
    best = min((v for v in ok if v.startswith("trl")), key=lambda v: ok[v]["step_time_s"], default=None)
    if best:
        lines.append("")
        lines += [
            f"- {v} / {best} (the faster TRL): {ok[best]['step_time_s'] / ok[v]['step_time_s']:.2f}x"
            for v in ok
            if v.startswith("hfpar")
        ]
    if "hfpar_fp8_compile" in ok and "hfpar_compile" in ok:
        f = ok["hfpar_compile"]["step_time_s"] / ok["hfpar_fp8_compile"]["step_time_s"]
        lines.append(f"- hfpar_fp8_compile / hfpar_compile: {f:.2f}x")
    return lines


def busy_table(busy: Path) -> list[str]:
    lines = ["| SFT run (0.9B Llama, packed 2048 x 8) | step wall ms | kernel ms | GPU busy |", "|---|---|---|---|"]
    for txt in sorted(busy.glob("profile_*.txt")):
        t = txt.read_text()
        m = re.search(r"step wall ([\d.]+) ms, kernels ([\d.]+) ms", t)
        wall, total = float(m.group(1)), float(m.group(2))
        top = t.split("top GPU kernels")[1]
        rows = re.findall(r"^\s*([\d.]+) ms/step\s+[\d.]+%\s+x\d+\s+(.+)$", top, re.M)
        kernels = total - sum(float(ms) for ms, name in rows if name.startswith(("hfpar::", "Optimizer.")))
        lines.append(f"| {txt.stem[8:]} | {wall:.1f} | {kernels:.1f} | {100 * kernels / wall:.1f}% |")
    lines.append("(kernel ms: the header's device total less the annotation rows of its top-40 list; an annotation")
    lines.append("outside that list, at most the smallest listed row, would count as kernel time)")
    return lines


def trace_events(path: Path) -> list[dict]:
    """A chrome trace's events, also from a gzip cut short (the round's time limit stopped its writer)."""
    dec, raw, out = zlib.decompressobj(16 + zlib.MAX_WBITS), path.read_bytes(), b""
    for i in range(0, len(raw), 1 << 16):
        try:
            out += dec.decompress(raw[i : i + (1 << 16)])
        except zlib.error:
            break
    text = out.decode("utf8", "ignore")
    i, dec_json, events = text.index("[", text.index('"traceEvents"')) + 1, json.JSONDecoder(), []
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec_json.raw_decode(text, i)
        except ValueError:
            return events
        events.append(obj)


def dpo_busy(trace: Path, steps: int = 3) -> str:
    ev = trace_events(trace)
    ann = [e for e in ev if e.get("cat") == "user_annotation"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    t0, t1 = min(e["ts"] for e in ann), max(e for _, e in gpu)
    union, (cs, ce) = 0.0, gpu[0]
    for s, e in gpu[1:]:
        if s > ce:
            union, cs, ce = union + ce - cs, s, e
        else:
            ce = max(ce, e)
    union += ce - cs
    return (
        f"DPO (hfpar, {trace.name}, {steps} profiled steps): {(t1 - t0) / steps / 1e3:.1f} ms per step, kernels "
        f"{union / steps / 1e3:.1f} ms: GPU busy {100 * union / (t1 - t0):.1f}%"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", help="unpacked all.tgz folders of a round's calls")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    lines = ["# GPU round: the tables (benchmarks/gpu/round_report.py)", ""]
    for d in map(Path, a.dirs):
        if (d / "peers" / "peers.json").exists():
            lines += ["## SFT side by side", "", *sft_table(d / "peers"), ""]
        if (d / "busy").is_dir():
            lines += ["## GPU busy", "", *busy_table(d / "busy"), ""]
        for trace in sorted((d / "dpo").glob("dpo_trace_*.json.gz")) if (d / "dpo").is_dir() else []:
            lines += [dpo_busy(trace), ""]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
