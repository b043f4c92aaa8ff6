"""One cp rank's attention work through hfpar's fused-kernel path against SDPA flash over the whole row, on one GPU.

    python -m benchmarks.context_parallel.gpu_attention --out DIR      # one CUDA GPU, bf16: about 1-2 minutes
    python -m benchmarks.context_parallel.gpu_attention --device cpu --lengths 256 512 --out /tmp/x   # same path, CPU

What a ring rank computes (hfpar/parallel/context_parallel/ring.py) minus the communication: its load-balanced
(zigzag) query shard against each of the cp K / V shards it meets, each shard cut in `pieces` runs as the ring
passes them, every (query shard, key piece) pair through the device's fused kernel (fused.add_blocks: one call per
document part, merged by log-sum-exp) and backward through the kernel's own backward (fused.blocks_backward) with
the merged output and log-sum-exp. cp = 1 is hfpar's fused_attention over the whole row (what ring_attention runs
at cp = 1). The communication cannot be measured on one GPU: NCCL refuses two ranks on one device, and gloo has no
send / recv of CUDA tensors, so the overlapped ring's transfers are left out (benchmarks/context_parallel/scaling.py
measures the whole ring, communication included, on CPU ranks).

1. Exactness, fp32 (float32 inputs: the CUDA path takes the efficient-attention kernel, with a bias where a window
   cuts): packed rows (2 rows, different documents, right padding), GQA, every rank of cp = 1, 2, 4 through the
   per-rank path, the ranks' dq and their dk / dv shares summed back to the whole row, against SDPA with the dense
   document-causal mask (output and input gradients); also with a sliding window, and SDPA's own fp32 error
   against float64 for scale; bf16: hfpar's cp = 2 rank path and SDPA (dense mask; flash on one document) against
   the fp32 reference.
2. Time (bf16, forward + backward, B = 1, H query / Hkv kv heads, head dim D) at each length T:
     sdpa_flash      F.scaled_dot_product_attention(is_causal=True), flash backend, whole row, one GPU: the baseline
     hfpar cp=c r=i  rank i's attention work at cp = c (ranks 0 and c-1: the zigzag balance shows as equal times)
     varlen          torch.nn.attention.varlen.varlen_attn on the packed row's documents (if importable)
   on a single-document row and on packed rows: "packed" (documents of T/8 .. 3T/8 tokens, as
   benchmarks/context_parallel/scaling.py) and "packed_1k" (documents of 256 .. 1792 tokens). Peak memory: bytes
   allocated beyond the inputs during the call. The kernel calls are cached per batch (RowLayout.cache) and reused by
   every layer, so they are built in the warm-up here, as in training.
Writes DIR/gpu_attention.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.context_parallel.gpu_attention_work import RankWork, layout, positions, timed, varlen_fn
from hfpar.parallel.context_parallel import doc_causal_mask, zigzag_indices
from hfpar.parallel.context_parallel.fused import (
    fused_attention,
)


def exactness(dev: str, cps, pieces: int, heads: int, kv_heads: int, d: int) -> list[dict]:
    """Per-rank path against SDPA with the dense document-causal mask, fp32 (and bf16): max abs differences."""
    gen = torch.Generator().manual_seed(1)
    b, t = 2, 1024
    pos = torch.stack([positions(t, "packed_1k", 1), positions(t, "packed", 2)])
    amask = torch.ones(b, t, dtype=torch.long)
    amask[1, 900:] = 0  # right padding: attends to itself only
    base = [torch.randn(b, n, t, d, generator=gen, dtype=torch.float64).to(dev) for n in (heads, kv_heads, kv_heads)]
    w = torch.randn(b, heads, t, d, generator=gen, dtype=torch.float64).to(dev)
    doc = layout(pos, 0, 1, dev, amask).doc
    gpos = torch.arange(t, device=dev)
    names = ("out", "dq", "dk", "dv")
    out = []

    def row(case, variant, window, got, ref):
        """got / ref: lists of tensors, or callables making them (an error is recorded, not raised)."""
        try:
            got, ref = (x() if callable(x) else x for x in (got, ref))
            diffs = {f: (a.double() - r.double()).abs().max().item() for f, a, r in zip(names, got, ref)}
        except Exception as exc:  # noqa: BLE001  (reported in the table, not hidden)
            diffs = {"error": repr(exc)[:300]}
        out.append({"case": case, "variant": variant, "window": window, **diffs})
        print(json.dumps(out[-1]), flush=True)

    def rank_path(dt, cp, window):
        """Every rank's work at cp, its dq and dk / dv shares put back in place: [out, dq, dk, dv] of the row."""
        q, k, v = (x.to(dt) for x in base)
        res = [
            torch.zeros_like(q),
            torch.zeros_like(q),
            torch.zeros_like(k, dtype=torch.float32),
            torch.zeros_like(v, dtype=torch.float32),
        ]
        for r in range(cp):
            rows = layout(pos, r, cp, dev, amask)
            loc = rows.local
            kv = {
                j: (k[:, :, zigzag_indices(t, j, cp).to(dev)], v[:, :, zigzag_indices(t, j, cp).to(dev)])
                for j in range(cp)
            }
            o, dq, grads = RankWork(rows, t, r, cp, pieces, window)(q[:, :, loc], kv, w[:, :, loc].to(dt))
            res[0][:, :, loc], res[1][:, :, loc] = o, dq.to(dt)
            for (src, a, bb), (dk, dv) in grads.items():
                idx = zigzag_indices(t, src, cp)[a:bb].to(dev)
                res[2][:, :, idx] += dk
                res[3][:, :, idx] += dv
        return res

    for window in (None, 200):
        mask = doc_causal_mask(doc, gpos, gpos, window)

        def sdpa(dt, mask=mask):
            q, k, v = (x.to(dt, copy=True).requires_grad_() for x in base)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            (o * w.to(dt)).sum().backward()
            return [o.detach(), q.grad, k.grad, v.grad]

        ref = sdpa(torch.float32)
        row("exact_fp32", "sdpa_mask_fp32_vs_float64", window, ref, lambda: sdpa(torch.float64))
        for cp in cps:
            row(
                "exact_fp32",
                f"hfpar_rank_path_cp{cp}",
                window,
                lambda cp=cp, window=window: rank_path(torch.float32, cp, window),
                ref,
            )
        row("exact_bf16", "sdpa_mask_bf16_vs_fp32", window, lambda: sdpa(torch.bfloat16), ref)
        row(
            "exact_bf16",
            "hfpar_rank_path_cp2_vs_fp32",
            window,
            lambda window=window: rank_path(torch.bfloat16, 2, window),
            ref,
        )
    # one document: SDPA's flash kernel (the timing baseline) against the fp32 reference, as a scale for the above
    q, k, v = base

    def flash():
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
            return [
                F.scaled_dot_product_attention(
                    q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, enable_gqa=True
                )
            ]

    row(
        "exact_bf16",
        "sdpa_flash_single_doc_vs_fp32",
        None,
        flash,
        lambda: [F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)],
    )
    return out


def speed_at(
    dev: str, t: int, rows_kinds, cps, pieces: int, heads: int, kv_heads: int, d: int, reps: int, deadline: float
) -> list[dict]:
    """The timing rows at length t (rows not started after `deadline`, a time.time(), are recorded as skipped)."""
    dt, out = torch.bfloat16, []

    def record(**r):
        out.append(r)
        print(json.dumps(r), flush=True)

    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, n, t, d, generator=gen).to(dev, dt).requires_grad_() for n in (heads, kv_heads, kv_heads))
    g = torch.randn(1, heads, t, d, generator=gen).to(dev, dt)

    def run(variant, row, cp, rank, make, **extra):
        if time.time() > deadline:
            return record(seq=t, row=row, variant=variant, cp=cp, rank=rank, error="skipped: time budget spent")
        try:
            ms, mib = timed(dev, make(), reps)
            record(seq=t, row=row, variant=variant, cp=cp, rank=rank, ms=ms, peak_mib=mib, **extra)
        except Exception as exc:  # noqa: BLE001  (reported in the table, not hidden)
            record(seq=t, row=row, variant=variant, cp=cp, rank=rank, error=repr(exc)[:300])
        q.grad = k.grad = v.grad = None

    def flash():
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)

    run("sdpa_flash", "single", 1, 0, lambda: flash)
    for row in rows_kinds:
        pos = positions(t, row, t)
        docs = int((pos == 0).sum())
        if row != "single" and (vfn := varlen_fn(q, k, v, pos)) is not None:
            run("varlen", row, 1, 0, lambda vfn=vfn: lambda: vfn().backward(g), docs=docs)
        for cp in cps:
            for r in sorted({0, cp - 1}):

                def make(r=r, cp=cp, pos=pos):
                    rl = layout(pos[None], r, cp, dev)
                    if cp == 1:  # what ring_attention runs at cp = 1
                        return lambda: fused_attention(q, k, v, rl, rl.local, rl.local).backward(g)
                    work = RankWork(rl, t, r, cp, pieces)
                    kv = {
                        j: (
                            k.detach()[:, :, zigzag_indices(t, j, cp).to(dev)].contiguous(),
                            v.detach()[:, :, zigzag_indices(t, j, cp).to(dev)].contiguous(),
                        )
                        for j in range(cp)
                    }
                    ql, gl = q.detach()[:, :, rl.local].contiguous(), g[:, :, rl.local].contiguous()
                    return lambda: work(ql, kv, gl)

                run("hfpar", row, cp, r, make, docs=docs)
    return out


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2e}"


def report(env: dict, res: list[dict]) -> str:
    lines = [
        f"# One cp rank's attention work on one {env['device_name']} (hfpar fused-kernel path), torch {env['torch']}",
        "",
        f"Command: `python -m benchmarks.context_parallel.gpu_attention {env['argv']}`; {env['date']}; "
        f"wall {env['wall_s']:.0f} s.",
        "Communication not included (one GPU: NCCL refuses two ranks per device).",
        "",
        "## Exactness (max abs difference; fp32 against SDPA with the dense mask, bf16 against fp32)",
        "",
        "| case | variant | window | out | dq | dk | dv |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res:
        if r.get("case", "").startswith("exact") and "error" in r:
            lines.append(
                f"| {r['case']} | {r['variant']} | {r.get('window') or ''} | failed: {r['error'][:150]} | | | |"
            )
        elif r.get("case", "").startswith("exact"):
            lines.append(
                f"| {r['case']} | {r['variant']} | {r.get('window') or ''} | {_fmt(r.get('out'))} | "
                f"{_fmt(r.get('dq'))} | {_fmt(r.get('dk'))} | {_fmt(r.get('dv'))} |"
            )
    lines += [
        "",
        (
            f"## Forward + backward, {env['dtype']}, B=1, H={env['heads']}, Hkv={env['kv_heads']}, "
            f"D={env['head_dim']}, ring pieces {env['pieces']}"
        ),
        "",
        "| T | row | docs | variant | cp | rank | ms | x sdpa_flash (whole row) | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["seq"]: r["ms"] for r in res if r.get("variant") == "sdpa_flash" and "ms" in r}
    for r in res:
        if "seq" not in r:
            continue
        if "error" in r:
            lines.append(
                f"| {r['seq']} | {r['row']} | | {r['variant']} | {r['cp']} | {r['rank']} | failed: "
                f"{r['error'][:150]} | | |"
            )
            continue
        ratio = f"{r['ms'] / base[r['seq']]:.2f}" if r["seq"] in base else ""
        mib = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {r['seq']} | {r['row']} | {r.get('docs', '')} | {r['variant']} | {r['cp']} | {r['rank']} | "
            f"{r['ms']:.2f} | {ratio} | {mib} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 4096 .. 32768 (cuda), 256 512 (cpu)")
    p.add_argument("--rows", nargs="+", default=["single", "packed", "packed_1k"])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pieces", type=int, default=4, help="K / V pieces per shard, as ring_attention's default")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--skip_exact", action="store_true")
    p.add_argument("--budget_s", type=float, default=120, help="no timing row is started after this many seconds")
    args = p.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/context_parallel/gpu_attention.py: no CUDA GPU here; --device cpu runs the same path on CPU"
        )
    lengths = args.lengths or ([4096, 8192, 16384, 32768] if dev == "cuda" else [256, 512])
    t0 = time.time()
    res = [] if args.skip_exact else exactness(dev, args.cps, args.pieces, args.heads, args.kv_heads, args.head_dim)
    for t in lengths:
        res += speed_at(
            dev,
            t,
            args.rows,
            args.cps,
            args.pieces,
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.reps,
            t0 + args.budget_s,
        )
    env = {
        "device_name": torch.cuda.get_device_name(0) if dev == "cuda" else "CPU",
        "torch": torch.__version__,
        "argv": " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": time.time() - t0,
        "dtype": "bf16",
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "pieces": args.pieces,
        "lengths": lengths,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_attention.json").write_text(json.dumps({"env": env, "results": res}, indent=2))
    md = report(env, res)
    (out / "gpu_attention.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
