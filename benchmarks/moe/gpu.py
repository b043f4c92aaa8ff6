"""MoE speed on one GPU, bf16: hfpar's block vs transformers' experts implementations, and a model slice's tokens/s.

    python -m benchmarks.moe.gpu --out benchmarks/results/gpu              # one CUDA GPU, about 2 minutes
    python -m benchmarks.moe.gpu --out /tmp/moe --device cpu --scale tiny  # the code path, on CPU

1. Block: forward + backward of one MoE layer (shapes.py) on the same B x T tokens (default 4 x 4096), median of
   --iters after 2 warm-up runs (eager: at most 3 after 1): transformers' eager / grouped_mm / batched_mm experts
   (batched_mm only where its per-copy weight gather fits in half the free memory) and hfpar's block at ep = 1
   (apply_expert_parallel: Qwen3-MoE becomes hfpar's MoELayer with GroupedExperts; DeepSeek-V3's block stays
   transformers' own, its experts in transformers' default implementation; hfpar shards only its experts at ep > 1).
   hfpar's output is compared with transformers' grouped_mm on the same tokens (bf16: relative difference).
   Shapes: Qwen3-30B-A3B (H 2048, 128 experts of 768, top-8) and DeepSeek-V3 (H 7168, 256 experts of 2048, top-8,
   1 shared expert, sigmoid group-limited router), real sizes.
2. Slice: a --slice_layers-layer Qwen3-30B-A3B-shaped CausalLM (real vocab, built from the config, random init),
   bf16 weights, one training step = forward + backward + fused AdamW on --slice_batch x --slice_seq tokens;
   tokens/s per GPU for transformers (grouped_mm) and hfpar (ep = 1), both built from the same seed (first-step
   losses compared).
ep > 1 needs one GPU per rank (NCCL refuses two ranks on one device), so this one-GPU script runs ep = 1 only; the
all-to-all path (ep = 2, 4) is measured on CPU by ep_cpu.py. Results are written after every section
(OUT/gpu.{json,md}); a section that would start after --budget_s seconds is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.launch import command
from benchmarks.moe.shapes import (
    batched_mm_bytes,
    build_model,
    describe,
    layer_config,
    moe_block,
    time_block,
)
from hfpar.parallel.expert_parallel import apply_expert_parallel

T0 = time.perf_counter()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 8 << 30  # CPU: allow 8 GiB


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_block(shape: str, a) -> dict:
    cfg = layer_config(shape, a.scale)
    model = build_model(cfg, a.device, a.dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(a.batch, a.seq, cfg.hidden_size, generator=gen).to(a.device, a.dtype)
    tokens = a.batch * a.seq
    row = {"shape": describe(cfg), "tokens": tokens, "ms": {}}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        need = batched_mm_bytes(cfg, tokens, a.dtype) if impl == "batched_mm" else 0
        if need > _free_bytes(a.device) // 2:
            row["ms"][f"transformers {impl}"] = f"skipped: gathers {need / 2**30:.0f} GiB of expert weights"
            continue
        try:
            model.set_experts_implementation(impl)
            # eager's backward adds a full-size (E, ...) gradient per expert hit (its weights are indexed per expert):
            # seconds per step on the DeepSeek-V3 layer, so fewer runs
            iters, warm = (min(a.iters, 3), 1) if impl == "eager" else (a.iters, 2)
            row["ms"][f"transformers {impl}"] = time_block(moe_block(model), x, iters, warm)
        except Exception as exc:  # an implementation this build lacks
            row["ms"][f"transformers {impl}"] = f"unavailable: {str(exc).splitlines()[0][:100]}"
        _free()
    model.set_experts_implementation("grouped_mm")  # transformers' default: hfpar keeps it
    with torch.no_grad():
        ref = moe_block(model)(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    apply_expert_parallel(model)
    block = moe_block(model)
    row["hfpar_block"] = type(block).__name__ + (
        f" (GroupedExperts backend {block.experts.backend})"
        if hasattr(block, "ep_size")
        else " (transformers' own block)"
    )
    with torch.no_grad():
        got = block(x)
    got = got[0] if isinstance(got, tuple) else got
    row["hfpar_vs_grouped_mm_rel"] = _rel(got, ref)
    del ref, got
    row["ms"]["hfpar ep=1"] = time_block(block, x, a.iters)
    nums = [v for k, v in row["ms"].items() if k.startswith("transformers") and isinstance(v, float)]
    row["hfpar_over_best"] = row["ms"]["hfpar ep=1"] / min(nums)
    del model, block, x
    _free()
    return row


def bench_slice(a) -> dict:
    cfg = layer_config("qwen3", a.scale, layers=a.slice_layers, vocab=151936 if a.scale == "real" else 512)
    tokens = a.slice_batch * a.slice_seq
    out = {
        "shape": describe(cfg),
        "layers": a.slice_layers,
        "vocab": cfg.vocab_size,
        "batch": a.slice_batch,
        "seq": a.slice_seq,
        "tokens_per_step": tokens,
        "variants": {},
    }
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (a.slice_batch, a.slice_seq), generator=gen).to(a.device)
    for name in ("transformers grouped_mm", "hfpar ep=1"):
        model = build_model(cfg, a.device, a.dtype, seed=0)
        if name.startswith("hfpar"):
            apply_expert_parallel(model)
        else:
            model.set_experts_implementation("grouped_mm")
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(a.device).type == "cuda")
        if torch.device(a.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(a.device)
        times, losses = [], []
        for i in range(a.slice_steps + 2):
            if torch.device(a.device).type == "cuda":
                torch.cuda.synchronize(a.device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # syncs
            if i >= 2:
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        v = {"step_ms": step * 1e3, "tokens_per_s": tokens / step, "first_loss": losses[0]}
        if torch.device(a.device).type == "cuda":
            v["peak_gib"] = torch.cuda.max_memory_allocated(a.device) / 2**30
        out["variants"][name] = v
        del model, opt, loss
        _free()
    t, h = out["variants"]["transformers grouped_mm"], out["variants"]["hfpar ep=1"]
    out["hfpar_over_transformers_tokens_per_s"] = h["tokens_per_s"] / t["tokens_per_s"]
    out["first_loss_rel_diff"] = abs(h["first_loss"] - t["first_loss"]) / abs(t["first_loss"])
    return out


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res["elapsed_s"] = time.perf_counter() - T0
    (out / "gpu.json").write_text(json.dumps(res, indent=2))
    L = [
        f"# MoE speed on one GPU ({res['device']}, {res['dtype']})",
        "",
        (
            f"Command: `{res['command']}` (torch {res['torch']}, transformers {res['transformers']}); "
            f"{res['elapsed_s']:.0f} s in all."
        ),
        "",
        (
            "ep > 1 needs one GPU per rank (NCCL refuses two ranks on one device): this one-GPU run is ep = 1; the "
            "all-to-all path (ep = 2, 4) is measured on CPU (ep_cpu.py)."
        ),
        "",
    ]
    for row in res["blocks"]:
        s = row.get("shape", {})
        if "error" in row:
            L += [f"## {row['name']}: {row['error']}", ""]
            continue
        L += [
            (
                f"## Block forward + backward: {row['name']} (H {s['hidden']}, {s['experts']} experts of "
                f"{s['expert_intermediate']}, top-{s['top_k']}, {s['router']}), {row['tokens']} tokens"
            ),
            "",
            (
                f"hfpar's block at ep = 1: {row['hfpar_block']}; its output vs transformers' grouped_mm on the same "
                f"tokens: {row['hfpar_vs_grouped_mm_rel']:.1e} relative; hfpar / best transformers: "
                f"{row['hfpar_over_best']:.2f}x."
            ),
            "",
            "| block | ms |",
            "|---|---|",
        ]
        L += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in row["ms"].items()]
        L.append("")
    if sl := res.get("slice"):
        if "error" in sl:
            L += [f"## Model slice: {sl['error']}", ""]
        else:
            L += [
                (
                    f"## Training step of a {sl['layers']}-layer Qwen3-30B-A3B-shaped slice ({sl['params'] / 1e9:.2f}B "
                    f"parameters, vocab {sl['vocab']}), {sl['batch']} x {sl['seq']} tokens, {res['dtype']} weights, "
                    "AdamW"
                ),
                "",
                (
                    f"hfpar / transformers tokens/s: {sl['hfpar_over_transformers_tokens_per_s']:.2f}x; first-step "
                    f"losses differ by {sl['first_loss_rel_diff']:.1e} relative (same seed)."
                ),
                "",
                "| model | step ms | tokens/s per GPU | peak GiB |",
                "|---|---|---|---|",
            ]
            for k, v in sl["variants"].items():
                L.append(
                    f"| {k} | {v['step_ms']:.0f} | {v['tokens_per_s']:.0f} | {v.get('peak_gib', float('nan')):.1f} |"
                )
            L.append("")
    L += [f"Skipped (past --budget_s {res['budget_s']}): {', '.join(res['skipped'])}"] if res["skipped"] else []
    (out / "gpu.md").write_text("\n".join(L) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu.{json,md}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--scale", default="real", choices=("real", "tiny"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--slice_layers", type=int, default=4)
    p.add_argument("--slice_batch", type=int, default=2)
    p.add_argument("--slice_seq", type=int, default=4096)
    p.add_argument("--slice_steps", type=int, default=5)
    p.add_argument("--budget_s", type=float, default=110, help="start no section after this many seconds")
    a = p.parse_args()
    a.dtype = getattr(torch, a.dtype)
    import transformers

    dev = torch.device(a.device)
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
        "dtype": str(a.dtype),
        "command": command(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "budget_s": a.budget_s,
        "args": {**vars(a), "dtype": str(a.dtype)},
        "blocks": [],
        "skipped": [],
    }
    out = Path(a.out)
    for shape in ("qwen3", "deepseek_v3"):
        if time.perf_counter() - T0 > a.budget_s:
            res["skipped"].append(f"block {shape}")
            continue
        try:
            res["blocks"].append({"name": shape, **bench_block(shape, a)})
        except Exception as exc:  # keep the other sections' numbers
            res["blocks"].append({"name": shape, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            _free()
        write(res, out)
        print(json.dumps(res["blocks"][-1]), flush=True)
    if time.perf_counter() - T0 > a.budget_s:
        res["skipped"].append("model slice")
    else:
        try:
            res["slice"] = bench_slice(a)
        except Exception as exc:
            res["slice"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    write(res, out)
    print((out / "gpu.md").read_text())


if __name__ == "__main__":
    main()
