"""hfpar's MoE block (EP=1) vs transformers' Mixtral sparse block with each experts implementation.

    python benchmarks/moe_block_speed.py          # writes benchmarks/results/moe_block_speed.{md,json}

Same weights, same input (B=4, T=256, H=128, 8 experts of I=256, top-2, fp32, CPU); forward +
backward of the block alone; median of 5 timed iterations after 2 warm-up ones.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def timed(block, x) -> float:
    times = []
    for i in range(7):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = block(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def main() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from hfpar.parallel.moe_apply import apply_expert_parallel

    cfg = MixtralConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    base = MixtralForCausalLM(cfg)
    x = torch.randn(4, 256, 128, generator=torch.Generator().manual_seed(1))
    res = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        m = copy.deepcopy(base)
        try:
            m.set_experts_implementation(impl)
            res[f"transformers {impl}"] = timed(m.model.layers[0].mlp, x)
        except Exception as exc:  # an implementation this torch/CPU does not offer
            res[f"transformers {impl}"] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    ours = apply_expert_parallel(copy.deepcopy(base)).model.layers[0].mlp
    from hfpar.parallel.moe import GroupedExperts

    for backend in ("loop", "grouped_mm", "auto"):
        ours.experts.backend = backend
        try:
            res[f"hfpar MoELayer ({backend})"] = timed(ours, x)
        except Exception as exc:
            res[f"hfpar MoELayer ({backend})"] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    ours.experts.backend = GroupedExperts.backend
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe_block_speed.json").write_text(json.dumps(res, indent=2))
    lines = ["# MoE block forward+backward (CPU, fp32)", "",
             f"Command: `python benchmarks/moe_block_speed.py` (torch {torch.__version__}); B=4, T=256, H=128, "
             "8 experts, I=256, top-2; median of 5 after 2 warm-up.", "", "| block | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in res.items()]
    (RESULTS / "moe_block_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
