"""The sft recipe on one GPU: tokens/s, peak memory and MFU of a ~0.9B Llama-style model (bf16 autocast).

    python -m benchmarks.gpu.sft --out benchmarks/results/gpu        # needs one CUDA GPU

Builds the model from a config (random init, saved once to a temp dir so the recipe loads it with
from_pretrained like any hub model), then runs `accelerate launch recipes/sft.py` with single.yaml and
fsdp2.yaml (1 process), each with and without --gradient_checkpointing, and single.yaml with
torch.compile (`accelerate launch --dynamo_backend inductor`). Every run's raw output is kept in
OUT/<variant>.log; the summary goes to OUT/sft.{md,json,png}.

MFU = model FLOPs per token x tokens/s / peak dense bf16 FLOP/s, with model FLOPs per token
= 6 N + 12 L d T (N = parameters in matmuls incl. lm_head, not the embedding lookup; L layers,
d hidden size, T sequence length: the PaLM convention). Recomputation under activation
checkpointing is not counted (that would be HFU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common.launch import ROOT, accelerate_cmd, command, results_dir

# Dense bf16 peak of the card (spec sheet, no sparsity).
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}

VARIANTS = {
    "single": ("single.yaml", [], []),
    "single_gc": ("single.yaml", [], ["--gradient_checkpointing"]),
    "single_flex": ("single.yaml", [], ["--attn_implementation", "flex_attention"]),
    "fsdp2": ("fsdp2.yaml", [], []),
    "fsdp2_gc": ("fsdp2.yaml", [], ["--gradient_checkpointing"]),
    "single_compile": ("single.yaml", ["--dynamo_backend", "inductor"], []),
    "fsdp2_compile": ("fsdp2.yaml", ["--dynamo_backend", "inductor"], []),
}


def peak_flops(name: str) -> float:
    for key, val in PEAK_BF16.items():  # most specific first
        if key in name:
            return val
    raise SystemExit(f"unknown GPU {name!r}: add its dense bf16 peak to PEAK_BF16")


def build_model(path: Path, args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    n_total = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    return {
        "params": n_total,
        "matmul_params": n_total - n_embed,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
    }


def run_variant(name: str, model_dir: Path, out: Path, args) -> dict:
    cfg_file, launch_extra, recipe_extra = VARIANTS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"hfpar-{name}-"))
    cmd = accelerate_cmd(
        Path(cfg_file).stem,
        1,
        "sft",
        [
            "--model_name_or_path",
            str(model_dir),
            "--tokenizer_name_or_path",
            str(ROOT / "hfpar" / "assets" / "tiny"),
            "--packing",
            "--max_seq_length",
            str(args.seq_len),
            "--per_device_train_batch_size",
            str(args.batch_size),
            "--max_steps",
            str(args.steps),
            "--eval_steps",
            "0",
            "--logging_steps",
            "5",
            "--save_final_model",
            "false",
            "--output_dir",
            str(run_dir),
            *recipe_extra,
        ],
        launch_extra,
        mixed_precision=None,
    )
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:  # streamed, so a run that is stopped still leaves its output
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        return {"variant": name, "error": " | ".join(tail)[-400:], "wall_s": wall}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "loss" in r and "eval_loss" not in r]
    timed = steps[args.warmup :]
    return {
        "variant": name,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_mem_gib": max(r["peak_mem_bytes"] for r in steps) / 2**30,
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "wall_s": wall,
    }


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = [r["variant"] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("tokens_per_s", "mfu", "peak_mem_gib"), ("tokens/s", "MFU", "peak memory (GiB)")):
        ax.bar(names, [r[key] for r in ok], color="tab:blue")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(results_dir("gpu")))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated, from {','.join(VARIANTS)}")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    args = p.parse_args()
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; valid: {', '.join(VARIANTS)}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu/sft.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name(0)
    peak = peak_flops(gpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="hfpar-gpu-model-"))
    info = build_model(model_dir, args)
    flops_per_token = 6 * info["matmul_params"] + 12 * info["layers"] * info["hidden"] * args.seq_len
    import accelerate
    import transformers

    env = {
        "gpu": gpu,
        "peak_bf16_flops": peak,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "command": command(),
        **info,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": flops_per_token,
    }
    print(json.dumps(env), flush=True)
    results = []
    for name in args.variants.split(","):
        r = run_variant(name, model_dir, out, args)
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * flops_per_token / peak
        print(json.dumps(r), flush=True)
        results.append(r)
        write_results(out, env, info, results, args)  # after every variant: a stopped run keeps what it measured
    print((out / "sft.md").read_text())


def write_results(out: Path, env: dict, info: dict, results: list[dict], args) -> None:
    gpu, peak, flops_per_token = env["gpu"], env["peak_bf16_flops"], env["flops_per_token"]
    (out / "sft.json").write_text(json.dumps({"env": env, "results": results}, indent=2))
    lines = [
        f"# sft recipe on one {gpu} (bf16 autocast, fp32 master weights)",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, transformers {env['transformers']}, accelerate "
        f"{env['accelerate']}. Llama-style model from config: {info['params'] / 1e9:.2f}B parameters "
        f"({info['layers']} layers, hidden {info['hidden']}), packed sequences of {args.seq_len}, batch "
        f"{args.batch_size}, {args.steps} steps, medians after {args.warmup} warm-up steps. MFU against "
        f"{peak / 1e12:.0f} TFLOP/s dense bf16, {flops_per_token / 1e9:.2f} GFLOP/token.",
        "",
        "| variant | tokens/s | step s | MFU | peak mem GiB | loss first→last | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | {r['wall_s']:.0f} |")
        else:
            lines.append(
                f"| {r['variant']} | {r['tokens_per_s']:.0f} | {r['step_time_s']:.3f} | {r['mfu']:.1%} | "
                f"{r['peak_mem_gib']:.1f} | {r['first_loss']:.2f}→{r['last_loss']:.2f} | {r['wall_s']:.0f} |"
            )
    (out / "sft.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "sft.png", f"hfpar sft, {info['params'] / 1e9:.2f}B Llama, {gpu}")


if __name__ == "__main__":
    main()
