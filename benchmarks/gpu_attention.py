"""Attention on packed rows and per-rank context-parallel attention on one GPU: time (fwd+bwd) and peak memory.

    python benchmarks/gpu_attention.py --out benchmarks/results/gpu        # needs one CUDA GPU

1. Packed rows (B rows of T tokens, documents of random lengths, bf16, H query / Hkv kv heads, head dim D), the
   attention of one layer, forward + backward, for each way of honouring the document boundaries:
     sdpa_causal      SDPA is_causal=True (flash): ignores the documents - the speed of light, not correct
     sdpa_mask        SDPA with the dense block-diagonal causal mask (what transformers builds for packed rows)
     hfpar_blocks     hfpar's blockwise document-causal attention (the Python block loop, every device)
     flex             torch flex_attention with a document-causal BlockMask (compiled)
     varlen           torch.nn.attention.varlen.varlen_attn (flash varlen) on the flattened rows
   each checked against sdpa_mask (max abs difference of the output).
2. Context parallelism, one rank's attention work at sequence length S (one document, causal): the cp=1 flash
   baseline and hfpar's blockwise attention of a load-balanced query shard (chunks r and 2cp-1-r) against the
   whole K/V (what a ring rank computes after the all-gather) at cp = 1, 2, 4. One GPU: the communication is not
   measured here (benchmarks/context_parallel.py counts it).
3. Exactness: fp32 packed rows with padding, hfpar's block attention against SDPA with the dense mask (output and input
   gradients), and tests/distributed/test_cp_attention.py's ring / Ulysses cases on 2 gloo ranks sharing the GPU.
Writes OUT/gpu_attention.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfpar.parallel.context_parallel.blockwise import block_attention, doc_causal_mask


def timed(fn, reps: int = 10) -> tuple[float, float]:
    """(ms per call, peak MiB above the inputs) of fn() including backward."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**20


def packed_docs(b: int, t: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) document id per position; documents of random length around `mean`."""
    doc = torch.empty(b, t, dtype=torch.long)
    for i in range(b):
        pos, d = 0, 0
        while pos < t:
            n = int(torch.randint(mean // 4, 2 * mean, (1,), generator=gen))
            doc[i, pos:pos + n] = d
            pos, d = pos + n, d + 1
    return doc


def packed_case(args) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    b, t, h, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    doc = packed_docs(b, t, args.doc_len, gen).to(dev)
    pos = torch.arange(t, device=dev)
    q = torch.randn(b, h, t, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, hkv, t, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, hkv, t, d, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(b, h, t, d, device=dev, dtype=dt)
    mask = doc_causal_mask(doc, pos, pos)
    variants = {
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "hfpar_blocks": lambda: block_attention(q, k, v, doc, pos, pos),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flat = doc
        bm = create_block_mask(lambda bb, hh, qi, ki: (flat[bb, qi] == flat[bb, ki]) & (ki <= qi), b, None, t, t,
                               device=dev)
        flex = torch.compile(flex_attention)
        variants["flex"] = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden)
        print(f"flex unavailable: {exc!r}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        lens = torch.cat([torch.bincount(doc[i]) for i in range(b)])
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        mx = int(lens.max())

        def varlen():
            qf, kf, vf = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (q, k, v))
            try:
                o = varlen_attn(qf, kf, vf, cu, cu, mx, mx, window_size=(-1, 0), enable_gqa=True)
            except TypeError:  # older signature: is_causal, no GQA
                rep = h // hkv
                o = varlen_attn(qf, kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1), cu, cu, mx, mx,
                                is_causal=True)
            return o.reshape(b, t, h, d).transpose(1, 2)
        variants["varlen"] = varlen
    except Exception as exc:  # noqa: BLE001
        print(f"varlen unavailable: {exc!r}")
    ref = variants["sdpa_mask"]().float()
    out = []
    for name, fn in variants.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            ms, mib = timed(lambda fn=fn: fn().backward(g))
            out.append({"case": "packed", "variant": name, "ms": ms, "peak_mib": mib, "max_abs_diff": err})
        except Exception as exc:  # noqa: BLE001
            out.append({"case": "packed", "variant": name, "error": repr(exc)[:300]})
        print(json.dumps(out[-1]), flush=True)
        q.grad = k.grad = v.grad = None
    return out


def cp_case(args) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    s, h, hkv, d = args.cp_seq, args.heads, args.kv_heads, args.head_dim
    doc = torch.zeros(1, s, dtype=torch.long, device=dev)
    k = torch.randn(1, hkv, s, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, hkv, s, d, device=dev, dtype=dt, requires_grad=True)
    kpos = torch.arange(s, device=dev)
    out = []
    qf = torch.randn(1, h, s, d, device=dev, dtype=dt, requires_grad=True)
    ms, mib = timed(lambda: F.scaled_dot_product_attention(qf, k, v, is_causal=True, enable_gqa=True)
                    .backward(torch.ones_like(qf)))
    out.append({"case": "cp", "variant": "flash_full", "cp": 1, "seq": s, "ms": ms, "peak_mib": mib})
    print(json.dumps(out[-1]), flush=True)
    for impl in ("blocks",):
        for cp in (1, 2, 4):
            c = s // (2 * cp)
            for r in ([0, cp - 1] if cp > 1 else [0]):  # the first and last rank: load balance shows as equal times
                qpos = torch.cat([torch.arange(r * c, (r + 1) * c),
                                  torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)]).to(dev)
                q = torch.randn(1, h, qpos.numel(), d, device=dev, dtype=dt, requires_grad=True)
                ms, mib = timed(lambda q=q, qpos=qpos: block_attention(q, k, v, doc, qpos, kpos)
                                .backward(torch.ones_like(q)), reps=3)
                out.append({"case": "cp", "variant": f"hfpar_{impl}_rank", "cp": cp, "rank": r, "seq": s, "ms": ms,
                            "peak_mib": mib})
                print(json.dumps(out[-1]), flush=True)
    return out


def exactness() -> list[dict]:
    """fp32 packed rows: hfpar's block attention against SDPA with the dense mask, output and input grads."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(1)
    b, t, h, hkv, d = 2, 1000, 8, 2, 64
    doc = packed_docs(b, t, 120, gen).to(dev)
    doc[1, 900:] = -1                                          # right padding: attends to itself only
    pos = torch.arange(t, device=dev)
    base = [torch.randn(b, n, t, d, generator=gen).to(dev) for n in (h, hkv, hkv)]
    w = torch.randn(b, h, t, d, generator=gen).to(dev)
    res = {}
    for name in ("sdpa_mask", "blocks"):
        q, k, v = (x.clone().requires_grad_() for x in base)
        if name == "sdpa_mask":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_causal_mask(doc, pos, pos), enable_gqa=True)
        else:
            o = block_attention(q, k, v, doc, pos, pos)
        (o * w).sum().backward()
        res[name] = [o.detach(), q.grad, k.grad, v.grad]
    out = []
    for name in ("blocks",):
        diffs = {f: (a - r).abs().max().item() for f, a, r in zip(("out", "dq", "dk", "dv"), res[name], res["sdpa_mask"])}
        out.append({"case": "exact_fp32", "variant": f"hfpar_{name}", **diffs})
        print(json.dumps(out[-1]), flush=True)
    return out


def ring_on_cuda() -> list[dict]:
    """tests/distributed/test_cp_attention.py's cases (ring and Ulysses, causal / packed / uneven rows, GQA) on 2 gloo ranks
    sharing this GPU, fp32: the all-gather / reduce-scatter path, against full-row SDPA."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.dist import run_distributed
    from tests.distributed.test_cp_attention import _check_all

    worst: dict = {}
    for per_rank in run_distributed(_check_all, 2, "cuda", torch.float32):
        for case, r in per_rank.items():
            worst[str(case)] = max(worst.get(str(case), 0.0), max(r.values()))
    out = [{"case": "cp_ring_ulysses_2ranks_fp32", "variant": c, "max_abs_diff": v} for c, v in worst.items()]
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc_len", type=int, default=300)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--cp_seq", type=int, default=32768)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_attention.py needs a CUDA GPU")
    res = exactness() + ring_on_cuda() + packed_case(args) + cp_case(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(args)}
    (out / "gpu_attention.json").write_text(json.dumps({"env": env, "results": res}, indent=2))
    lines = [f"# Attention on one {env['gpu']} (bf16, forward + backward), torch {env['torch']}", "",
             f"`python benchmarks/gpu_attention.py` with {vars(args)}", "",
             "| case | variant | cp | rank | ms | peak MiB | max abs diff vs sdpa_mask |", "|---|---|---|---|---|---|---|"]
    for r in res:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | | | failed: {r['error'][:120]} | | |")
            continue
        if "ms" not in r:  # exactness rows
            diff = r.get("max_abs_diff", max(r.get(f, 0.0) for f in ("out", "dq", "dk", "dv")))
            lines.append(f"| {r['case']} | {r['variant']} | | | | | {diff:.2e} |")
            continue
        lines.append(f"| {r['case']} | {r['variant']} | {r.get('cp', '')} | {r.get('rank', '')} | {r['ms']:.2f} | "
                     f"{r['peak_mib']:.0f} | {r.get('max_abs_diff', float('nan')):.2e} |")
    (out / "gpu_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
