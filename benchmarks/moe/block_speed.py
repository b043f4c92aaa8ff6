"""hfpar's MoE block (EP=1) vs transformers' Mixtral sparse block with each experts implementation.

    python -m benchmarks.moe.block_speed          # writes benchmarks/results/moe/block_speed.{md,json}
    python -m benchmarks.moe.block_speed --device cuda --dtype bfloat16 --tokens 16384 --hidden 2048 \
        --intermediate 1408 --experts 16 --iters 10 --name block_speed_gpu     # on a GPU

Same weights, same input (default: B=4, T=256, H=128, 8 experts of I=256, top-2, fp32, CPU); forward +
backward of the block alone; median of 5 (--iters) timed iterations after 2 warm-up ones.
"""

from __future__ import annotations

import copy
import json
import statistics
import time

import torch

from benchmarks.common.launch import command, results_dir

RESULTS = results_dir("moe")


def _sync(x) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def timed(block, x, iters: int = 5, warmup: int = 2) -> float:
    times = []
    for i in range(iters + warmup):
        xi = x.detach().requires_grad_(True)
        _sync(x)
        t0 = time.perf_counter()
        out = block(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        _sync(x)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def main() -> None:
    import argparse

    from transformers import MixtralConfig, MixtralForCausalLM

    from hfpar.parallel.expert_parallel import apply_expert_parallel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tokens", type=int, default=1024, help="B*T tokens in the batch (B=4)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--name", default="block_speed", help="results file stem under benchmarks/results/moe/")
    a = p.parse_args()
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    cfg = MixtralConfig(
        vocab_size=128,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=a.experts,
        num_experts_per_tok=a.top_k,
    )
    torch.manual_seed(0)
    base = MixtralForCausalLM(cfg).to(dev, dtype)
    x = torch.randn(4, a.tokens // 4, a.hidden, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    res = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        m = copy.deepcopy(base)
        try:
            m.set_experts_implementation(impl)
            res[f"transformers {impl}"] = timed(m.model.layers[0].mlp, x, a.iters)
        except Exception as exc:  # an implementation this torch/CPU does not offer
            res[f"transformers {impl}"] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    ours = apply_expert_parallel(copy.deepcopy(base)).model.layers[0].mlp
    from hfpar.parallel.expert_parallel.moe import GroupedExperts

    for backend in ("loop", "grouped_mm", "auto"):
        ours.experts.backend = backend
        try:
            res[f"hfpar MoELayer ({backend})"] = timed(ours, x, a.iters)
        except Exception as exc:
            res[f"hfpar MoELayer ({backend})"] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    ours.experts.backend = GroupedExperts.backend
    RESULTS.mkdir(parents=True, exist_ok=True)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    (RESULTS / f"{a.name}.json").write_text(json.dumps({"device": where, "args": vars(a), "ms": res}, indent=2))
    lines = [
        f"# MoE block forward+backward ({where}, {a.dtype})",
        "",
        f"Command: `{command()}` (torch {torch.__version__}); B=4, T={a.tokens // 4}, "
        f"H={a.hidden}, {a.experts} experts, I={a.intermediate}, top-{a.top_k}; median of {a.iters} after 2 "
        "warm-up.",
        "",
        "| block | ms |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in res.items()]
    (RESULTS / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
