"""SFT side by side on one GPU: hfpar's recipe (eager, compiled, FP8) and TRL's SFTTrainer on the same model, the
same packed token stream and the same row order, bf16 autocast over fp32 weights in both.

    python -m benchmarks.gpu.peers --out DIR                        # one CUDA GPU: a Llama-3.2-3B-shaped model
    python -m benchmarks.gpu.peers --out DIR --shape tiny --device cpu --steps 3 --warmup 1    # the code path on CPU

The model is built from a config (random init, saved once so both load it with from_pretrained: no downloads). The
data is generated text (seeded random words) that hfpar's sft recipe tokenizes and packs into rows of --seq_len
tokens (`--packing`: position ids restart at each document, no attention mask); TRL gets exactly those rows in the
order hfpar's sampler trains them (a sequential sampler), as a pre-tokenized dataset with their `seq_lengths`, under
its padding-free collator (TRL's documented fast path: padding_free; Liger kernels and compile as variants).
Attention is transformers' sdpa in both (the packed-sequence mask from the position ids): FlashAttention's package,
which TRL documents for padding-free, cannot be installed on the benchmark machine (no network, no wheel for its
torch). The hfpar_varlen variants join each step's packed rows into one row and run torch's own FlashAttention-2
varlen kernel (`--attn_implementation hfpar_varlen`), which needs no package.

Per variant, each in a fresh process: tokens/s (mean real tokens of the steps after --warmup over their median step
time, the step synchronised: a compiled run's later steps can still recompile), MFU (6 N + 12 L d T FLOPs per token,
PaLM's convention; recomputation not counted), peak memory (torch.cuda.max_memory_allocated), per-step losses.
Raw logs: OUT/logs/<variant>.log; summary OUT/peers.{json,md}; benchmarks/gpu/round_report.py makes the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.baselines.sft_runs import recipe_rows
from benchmarks.common.launch import ROOT, accelerate_cmd, command, env, module_cmd
from benchmarks.gpu.sft import peak_flops

SHAPES = {  # Llama-3.2-3B's published config (tied embeddings, GQA 24:8, 128256 vocabulary)
    "llama3_3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, max_position_embeddings=512),
}  # fmt: skip
FP8 = "single_fp8"  # single.yaml with the fp8 lines of accelerate_configs/fsdp2_fp8.yaml (written by fp8_config)
VARIANTS = {  # name -> (framework, hfpar launch config or TRL SFTConfig overrides, hfpar recipe flags)
    "hfpar": ("hfpar", "single", []),
    "hfpar_compile": ("hfpar", "single", ["--torch_compile"]),
    "hfpar_fp8": ("hfpar", FP8, []),
    "hfpar_fp8_compile": ("hfpar", FP8, ["--torch_compile"]),
    "hfpar_fp8_rowwise_compile": ("hfpar", FP8, ["--torch_compile", "--fp8_recipe", "rowwise"]),
    "hfpar_liger": ("hfpar", "single", ["--use_liger_kernel"]),
    # a step's packed rows joined into one row, attention by torch's FlashAttention-2 varlen kernel (hfpar.train.varlen)
    "hfpar_varlen": ("hfpar", "single", ["--attn_implementation", "hfpar_varlen"]),
    "hfpar_varlen_compile": ("hfpar", "single", ["--attn_implementation", "hfpar_varlen", "--torch_compile"]),
    "hfpar_varlen_fp8_compile": ("hfpar", FP8, ["--attn_implementation", "hfpar_varlen", "--torch_compile"]),
    "trl": ("trl", {}, []),
    "trl_liger": ("trl", {"use_liger_kernel": True}, []),  # Liger's RMSNorm / SwiGLU / RoPE / fused linear CE
    "trl_compile": ("trl", {"torch_compile": True}, []),
}
LR = 2e-5


def write_data(path: Path, docs: int, seed: int = 0) -> None:
    """Generated documents of 50-600 words (the tiny tokenizer has a token per character: ~6.5 a word)."""
    rng = random.Random(seed)
    words = [w for w in "the a of to in and is was for on that with by as at from it his an were are which".split()]
    words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 600)))}) + "\n")


def fp8_config(work: Path) -> Path | None:
    """single.yaml made fp8 (Accelerate's `mixed_precision: fp8` with its torchao backend, tensorwise: the recipe
    flag --fp8_recipe picks rowwise), as accelerate_configs/fsdp2_fp8.yaml says any config becomes; None where this
    tree has no fp8 support."""
    if not (ROOT / "accelerate_configs" / "fsdp2_fp8.yaml").exists():
        return None
    text = (ROOT / "accelerate_configs" / "single.yaml").read_text()
    text = text.replace("mixed_precision: bf16", "mixed_precision: fp8")
    path = work / f"{FP8}.yaml"
    path.write_text(text + "fp8_config:\n  backend: AO\n  recipe: tensorwise\n")
    return path


def build_model(path: Path, shape: str, device: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)  # bf16 on disk (half the bytes); both load fp32 weights
    n = sum(p.numel() for p in model.parameters())
    # tied: the head's matmul counts once (its weight is the embedding, whose lookup costs nothing)
    return {"params": n, "matmul_params": n, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}


def recipe_flags(a, data: Path, model: Path) -> list[str]:
    return [
        "--model_name_or_path", str(model), "--tokenizer_name_or_path", str(ROOT / "hfpar" / "assets" / "tiny"),
        "--dataset_name", str(data), "--packing", "--max_seq_length", str(a.seq_len),
        "--per_device_train_batch_size", str(a.batch_size), "--max_steps", str(a.steps), "--learning_rate", str(LR),
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--max_grad_norm", "1.0", "--seed", "42",
        "--eval_steps", "0", "--logging_steps", "1", "--save_final_model", "false",
    ]  # fmt: skip


def rows_in_order(flags: list[str], steps: int, batch: int) -> list[dict]:
    """The packed rows hfpar's sft recipe trains, step by step (benchmarks/baselines/sft_runs.py's recipe_rows: its
    data builder and sampler), with each row's document lengths (seq_lengths, from the position ids)."""
    train, per_step = recipe_rows(flags, steps, batch)
    out = []
    for i in (i for ix in per_step for i in ix):
        pos = train[i]["position_ids"]
        starts = [j for j, p in enumerate(pos) if p == 0] + [len(pos)]
        out.append({"input_ids": train[i]["input_ids"], "seq_lengths": [b - a for a, b in zip(starts, starts[1:])]})
    return out


def trl_worker(spec: dict) -> None:
    """One TRL SFTTrainer run in this fresh process -> spec['result'] (JSON)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hfpar import data

    rows = rows_in_order(spec["flags"], spec["steps"], spec["batch"])
    ends, tokens, losses = [], [], []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            tokens.append(int(inputs["input_ids"].numel()))  # padding-free: one row, no padding
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-peers-"), per_device_train_batch_size=spec["batch"],
        max_steps=spec["steps"], learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", seed=42, disable_tqdm=True,
        bf16=torch.cuda.is_available(), gradient_checkpointing=False, padding_free=True, max_length=None,
        train_sampling_strategy="sequential", dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(), **spec["overrides"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)  # fp32 weights, as hfpar's
    trainer = Counting(
        model=model, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=data.load_tokenizer(str(ROOT / "hfpar" / "assets" / "tiny")), callbacks=[StepEnds()],
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([t0, *ends[:-1]], ends)]
    w = spec["warmup"]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    result = {"tokens_per_s": statistics.mean(tokens[w:]) / statistics.median(times[w:]), "losses": losses,
              "peak_mem_bytes": peak, "step_times": times, "tokens": tokens,
              "step_time_s": statistics.median(times[w:])}  # fmt: skip
    Path(spec["result"]).write_text(json.dumps(result))


def run_variant(name: str, a, data: Path, model: Path, logs: Path) -> dict:
    kind, cfg, extra = VARIANTS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"peers-{name}-"))
    flags = recipe_flags(a, data, model)
    if kind == "hfpar":
        if cfg == FP8:
            cfg = fp8_config(data.parent)
            if cfg is None:
                return {"variant": name, "error": "no fp8 support in this tree (accelerate_configs/fsdp2_fp8.yaml)"}
            cfg = str(cfg.with_suffix(""))  # accelerate_cmd adds .yaml (an absolute path replaces its folder)
        mp = None if str(cfg).endswith(FP8) else ("bf16" if a.device == "cuda" else "no")
        cmd = accelerate_cmd(cfg, 1, "sft", [*flags, "--output_dir", str(run_dir), *extra], mixed_precision=mp)
    else:
        spec = {"flags": flags, "steps": a.steps, "batch": a.batch_size, "warmup": a.warmup, "model": str(model),
                "overrides": cfg, "result": str(run_dir / "trl.json")}  # fmt: skip
        cmd = module_cmd("benchmarks.gpu.peers", "--trl_worker", json.dumps(spec))
    log = logs / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        # on CPU (the code path only) fp8 runs in torchao's emulation, which hfpar takes only when asked
        e = env(cpu=a.device == "cpu", threads=None, **({"HFPAR_FP8_EMULATE": "1"} if a.device == "cpu" else {}))
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=e, timeout=a.variant_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"variant": name, "error": " | ".join(log.read_text().strip().splitlines()[-3:])[-500:], "wall_s": wall}
    if kind == "trl":
        return {"variant": name, **json.loads((run_dir / "trl.json").read_text()), "wall_s": wall}
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "loss" in r]
    timed = steps[a.warmup :]
    # at the median step: a compiled run's later steps can still recompile (packed rows vary in length)
    rate = statistics.mean(r["tokens_per_s"] * r["step_time_s"] for r in timed) / statistics.median(
        r["step_time_s"] for r in timed
    )
    return {"variant": name, "tokens_per_s": rate, "losses": [r["loss"] for r in steps],
            "peak_mem_bytes": max(r.get("peak_mem_bytes", 0) for r in steps),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed), "wall_s": wall,
            "compile_s": steps[-1].get("compile_s"), "steps": steps}  # fmt: skip


def table(env_: dict, results: list[dict]) -> str:
    ok = {r["variant"]: r for r in results if "error" not in r}
    base = ok.get("hfpar", {}).get("losses")
    lines = [f"{env_['gpu']}, {env_['shape']} ({env_['params'] / 1e9:.2f}B), rows of {env_['seq_len']} tokens x "
             f"{env_['batch_size']}, {env_['steps']} steps ({env_['warmup']} warm-up), bf16 autocast, fp32 weights",
             "", f"`{env_['command']}`", "",
             "| variant | tokens/s | MFU | step ms | peak GiB | compile s | loss first / last | max rel. loss diff |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:200]} | | | | | | |")
            continue
        diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base)) if base else float("nan")
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {1e3 * r['step_time_s']:.0f} | "
            f"{r['peak_mem_bytes'] / 2**30:.1f} | {r.get('compile_s') or ''} | {r['losses'][0]:.4f} / "
            f"{r['losses'][-1]:.4f} | {diff:.1e} |"
        )
    peers = [v for v in ok if v.startswith("trl")]
    if peers and "hfpar" in ok:
        best = max(peers, key=lambda v: ok[v]["tokens_per_s"])
        for v in (v for v in ok if v.startswith("hfpar")):
            lines.append(f"\n{v} / {best} (best peer): {ok[v]['tokens_per_s'] / ok[best]['tokens_per_s']:.2f}x")
    for v, b in (
        ("hfpar_fp8", "hfpar"),
        ("hfpar_fp8_compile", "hfpar_compile"),
        ("hfpar_fp8_rowwise_compile", "hfpar_compile"),
        ("hfpar_varlen", "hfpar"),
        ("hfpar_varlen_compile", "hfpar_compile"),
        ("hfpar_varlen_fp8_compile", "hfpar_varlen_compile"),
    ):
        lines += ratio_lines(ok, v, b)
    return "\n".join(lines) + "\n"


def ratio_lines(ok: dict, v: str, b: str) -> list[str]:
    """ "v / b: N.NNx" (tokens/s) when both variants ran ({variant: result}), else nothing."""
    return [f"\n{v} / {b}: {ok[v]['tokens_per_s'] / ok[b]['tokens_per_s']:.2f}x"] if v in ok and b in ok else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for peers.{json,md} and logs/ (required)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated, from {','.join(VARIANTS)}")
    p.add_argument("--shape", default="llama3_3b", choices=list(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the rates (compilation, allocation)")
    p.add_argument("--docs", type=int, default=400, help="generated documents")
    p.add_argument("--variant_timeout", type=float, default=300)
    p.add_argument("--trl_worker", help=argparse.SUPPRESS)  # a TRL run in a fresh process (JSON spec)
    a = p.parse_args()
    if a.trl_worker:
        trl_worker(json.loads(a.trl_worker))
        return
    if not a.out:
        raise SystemExit("--out: required (a folder for peers.json / peers.md and logs/)")
    names = a.variants.split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; valid: {', '.join(VARIANTS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (--device cpu --shape tiny runs the code path)")
    out, logs = Path(a.out), Path(a.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    write_data(work / "docs.jsonl", a.docs)
    info = build_model(work / "model", a.shape, a.device)
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    flops = 6 * info["matmul_params"] + 12 * info["layers"] * info["hidden"] * a.seq_len
    env_ = {"gpu": gpu, "shape": a.shape, **info, "seq_len": a.seq_len, "batch_size": a.batch_size,
            "steps": a.steps, "warmup": a.warmup, "flops_per_token": flops, "command": command(),
            "torch": torch.__version__, "cuda_env": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip
    peak = peak_flops(gpu) if a.device == "cuda" else float("nan")
    results = []
    for name in names:
        print(f"[peers] {name}", flush=True)
        try:
            r = run_variant(name, a, work / "docs.jsonl", work / "model", logs)
        except subprocess.TimeoutExpired:
            r = {"variant": name, "error": f"over --variant_timeout {a.variant_timeout} s"}
        if "error" not in r:
            r["mfu"] = flops * r["tokens_per_s"] / peak
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
        (out / "peers.json").write_text(json.dumps({"env": env_, "results": results}, indent=1))
        (out / "peers.md").write_text(table(env_, results))
    print((out / "peers.md").read_text())


if __name__ == "__main__":
    main()
