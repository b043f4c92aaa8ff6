"""Activation memory per rank with and without sequence parallelism, and TP=1 layer overhead.

    python -m benchmarks.tensor_parallel.activation_memory   # writes results/tensor_parallel/activation_memory.{md,png}

Activation memory is measured exactly, not estimated: the bytes of every tensor autograd saves for
backward during one forward (torch.autograd.graph.saved_tensors_hooks), per rank, for a Llama-style
model (hidden 256, 4 layers, 8 heads, batch 4 x 512 tokens, fp32) unsharded, with TP=2, and with
TP=2 + sequence parallelism (2 gloo ranks on CPU). Tensors saved twice (same storage) count once; parameters are
excluded. The overhead part times forward+backward of hfpar's Column/Row layers at group size 1 against the
nn.Linear MLP they replace (median of 20 after 5 warm-up iterations).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks.common.activation_bytes import saved_tensor_bytes
from benchmarks.common.launch import results_dir, run_ranks

RESULTS = results_dir("tensor_parallel")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def saved_bytes(model, ids) -> int:
    """Bytes of activations autograd keeps for backward; parameters (also saved by matmuls) excluded."""
    return saved_tensor_bytes(model, lambda: model(input_ids=ids, use_cache=False).logits.sum())[0]


def _ranked(rank: int, world: int, sp: bool):
    import torch.distributed as dist

    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    model = _model()
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    ids = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(1))
    return saved_bytes(model, ids)


def mlp_overhead() -> dict:
    import os

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    up, down = nn.Linear(1024, 4096), nn.Linear(4096, 1024)
    col, row = ColumnParallelLinear.from_linear(up), RowParallelLinear.from_linear(down)
    x = torch.randn(8, 256, 1024, requires_grad=True)

    def timeit(fn):
        times = []
        for i in range(25):
            t0 = time.perf_counter()
            fn().sum().backward()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    base = timeit(lambda: down(F.gelu(up(x))))
    ours = timeit(lambda: row(F.gelu(col(x))))
    dist.destroy_process_group()
    return {"nn_linear_ms": base * 1e3, "hfpar_tp1_ms": ours * 1e3, "overhead_pct": 100 * (ours / base - 1)}


def main() -> None:
    ids = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(1))
    full = saved_bytes(_model(), ids)
    tp = run_ranks(_ranked, 2, False)
    sp = run_ranks(_ranked, 2, True)
    over = mlp_overhead()
    res = {"unsharded": full, "tp2": tp, "tp2_sp": sp, **over}
    (RESULTS / "activation_memory.json").write_text(json.dumps(res, indent=2))
    md = [
        "# Activation memory per rank (bytes saved for backward, one forward)",
        "",
        "Command: `python -m benchmarks.tensor_parallel.activation_memory` (CPU, gloo, fp32; Llama hidden 256, 4 "
        "layers, "
        "8 heads, vocab 512, batch 4 x 512 tokens)",
        "",
        "| setup | rank 0 MB | vs unsharded |",
        "|---|---|---|",
        f"| 1 process, no TP | {full / 1e6:.1f} | 1.00 |",
        f"| TP=2 | {tp[0] / 1e6:.1f} | {tp[0] / full:.2f} |",
        f"| TP=2 + sequence parallel | {sp[0] / 1e6:.1f} | {sp[0] / full:.2f} |",
        "",
        "TP=1 overhead of hfpar's Column/Row layers vs nn.Linear (MLP 1024->4096->1024, batch 8x256, fwd+bwd, median):",
        f"{over['nn_linear_ms']:.1f} ms vs {over['hfpar_tp1_ms']:.1f} ms ({over['overhead_pct']:+.1f}%).",
    ]
    (RESULTS / "activation_memory.md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(
        ["no TP", "TP=2", "TP=2 + SP"], [full / 1e6, tp[0] / 1e6, sp[0] / 1e6], color=["gray", "tab:blue", "tab:green"]
    )
    ax.set_ylabel("MB saved for backward (rank 0)")
    ax.set_title("activation memory per rank")
    fig.tight_layout()
    fig.savefig(RESULTS / "activation_memory.png", dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    main()
