"""torchtitan beside benchmarks/gpu/peers.py (issue #41): torchtitan's own Trainer and Llama-3 model on the packed
rows that hfpar's sft recipe trains in peers.py, in the same order, with the Llama-3.2-3B shape of peers.py's
SHAPES["llama3_3b"] (checked field by field, tied embeddings included, and by parameter count against hfpar's model).

    python -m benchmarks.gpu.titan --out DIR            # one CUDA GPU: titan, titan_compile, titan_fp8_compile
    python -m benchmarks.gpu.titan --out DIR --device cpu --shape tiny --seq_len 256 --steps 3 --warmup 1 --docs 40

torchtitan is optional (no hfpar dependency; imported by the worker and the import check only). The installed version
picks the setup: 0.3.x -> titan_v03.py (needs torch >= 2.13, main() says what fails with 2.11 and 2.12.1, and triton,
imported at module level, on CPU too); 0.2.x -> titan_v02.py (0.2.2: the newest release that trains on torch 2.11,
the H200 image's). Offline install of the wheels in .devwheels/titan (torchtitan 0.2.2 and 0.3.0, and what they import
that the image lacks: torchdata, tyro, docstring_parser, typeguard; spmd_types for 0.3; wandb only when enabled), one
torchtitan at a time (0.3.0: its wheel and spmd_types' instead of torchtitan-0.2.2's):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan \
        .devwheels/titan/{torchtitan-0.2.2,torchdata,tyro,docstring_parser,typeguard}-*.whl
    export PYTHONPATH=/tmp/titan:$PYTHONPATH

Both: torchtitan's single-GPU setup (its llama3 configs), fused AdamW (hfpar's betas, no weight decay, peers.py's
constant lr), flex attention with a per-document causal mask (compiled in every variant), no activation checkpointing
(as peers.py), seed 42; titan_compile: its per-block torch.compile + the loss; fp8: torchao's rowwise recipe through
its float8 converter, the head left out (hfpar converts the decoder blocks' Linear layers only). 0.3: its 3B flavor,
fp32 weights under FSDP2 fully_shard on a 1-rank mesh (bf16 params, fp32 reduce), the document mask from the position
ids, its chunked cross-entropy, on CUDA the forward+backward in a CUDA graph (fixed shapes). 0.2 (what differs,
titan_v02.py says how): no 3B flavor and no weight tying in its llama3, so the model is its Transformer built from
SHAPES with the head tied here; one GPU gets no FSDP (fp32 weights, bf16 torch.autocast); the document mask is by EOS
token (the rows are checked: each position restart follows an EOS; pads are EOS); cross-entropy over the whole logits
(more memory than 0.3's chunked one); no CUDA graph. Data: peers.py's rows (hfpar's tokenizer, --packing and
sampler), each document with its own positions, targets = the next token (transformers' shift), padded to --seq_len
(--pad longest: to the batch's longest row, as hfpar's collator, no CUDA graph) with position 0 and label -100.
Figures as peers.py's: tokens/s = mean real tokens of the steps after --warmup / their median step time (synchronised),
MFU = (6 N + 12 L d T) FLOPs/token x tokens/s / benchmarks.gpu.sft.peak_flops, peak memory = max_memory_allocated per
step (read in torchtitan's metrics-logger hook before it resets the peak), beside torchtitan's own tps (padded tokens),
mfu and reserved memory. Logs OUT/logs/<variant>.log, summary OUT/titan.{json,md}. --device cpu: the code path only
(cpu_shim says what torchtitan lacks there and what stands in).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import types
from pathlib import Path

import torch
import torch._utils
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common.launch import ROOT, command, env, module_cmd
from benchmarks.gpu.peers import SHAPES, ratio_lines, recipe_flags, write_data
from benchmarks.gpu.sft import peak_flops
from hfpar import data, recipes
from hfpar.config import parse_args
from hfpar.train.compile import compile_seconds
from hfpar.train.sampler import GlobalBatchSampler

SETUPS = {"0.2": "benchmarks.gpu.titan_v02", "0.3": "benchmarks.gpu.titan_v03"}  # torchtitan minor -> its setup
TORCH_NEEDS = {"0.3": ((2, 13), "2.11: ImportError, no torch.distributed.fsdp.DataParallelMeshDims; 2.12.1: "
                                "TypeError, create_block_mask() has no separate_full_blocks")}  # fmt: skip
PRECISION = {"0.2": "no FSDP on 1 rank: fp32 weights, bf16 autocast",
             "0.3": "FSDP2 on 1 rank: bf16 params, fp32 reduce"}  # torchtitan's single-GPU precision  # fmt: skip
VARIANTS = {"titan": (False, False), "titan_compile": (True, False), "titan_fp8": (False, True),
            "titan_fp8_compile": (True, True)}  # name -> (torch.compile, float8 rowwise)  # fmt: skip
DEFAULTS = {"cuda": "titan,titan_compile,titan_fp8_compile", "cpu": "titan,titan_compile,titan_fp8"}
LR = 2e-5  # peers.py's
IGNORE_INDEX = -100  # torchtitan's and transformers' label to leave out of the loss


def hfpar_rows(flags: list[str], steps: int, batch: int) -> list[dict]:
    """The packed rows hfpar's sft recipe trains, step by step, with their position ids: peers.py's rows_in_order by
    benchmarks/baselines/sft_runs.py's recipe_rows (its data builder and sampler), with the plan field one_row that
    recipe_rows lacks at 55b8681 (AttributeError in hfpar/recipes/_text.py)."""
    recipe = recipes.get("sft")
    args = parse_args(
        flags, recipe="sft", defaults=dict(recipe.defaults), demo=dict(recipe.demo), args_class=recipe.args_class
    )
    plan = types.SimpleNamespace(task="lm", padding_free=False, image_text=False, one_row=False)
    ctx = types.SimpleNamespace(seq_multiple=1)
    train, *_ = recipe.build_data(args, data.load_tokenizer(args.tokenizer_path), ctx, plan)
    order = [i for _, _, m in GlobalBatchSampler(len(train), batch, 1, 0, 1, args.seed).iterate(0, steps) for ix in m
             for i in ix]  # fmt: skip
    return [{"input_ids": train[i]["input_ids"], "position_ids": train[i]["position_ids"]} for i in order]


def hf_params(shape: str) -> int:
    """Parameters of hfpar's model of that shape (transformers' Llama as peers.py builds it; tied: counted once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).parameters())


def setup_version() -> tuple[str, str]:
    """(installed torchtitan version, its setup's minor); one line where it is missing or neither 0.2 nor 0.3."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("torchtitan is not installed (wheels: this file's docstring)") from None
    minor = ".".join(version.split(".")[:2])
    if minor not in SETUPS:
        raise SystemExit(f"torchtitan {version}: this file sets up {' and '.join(SETUPS)} only")
    return version, minor


def cpu_shim() -> None:
    """torchtitan (0.2 and 0.3) cannot train its Llama-3 on CPU. 1. No CPU device: torchtitan/tools/utils.py takes
    `_get_available_device_type() or "cuda"`, so on a CPU build its Trainer fails in torch.cuda.set_device
    (AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'). 2. Its flex attention has no CPU backward
    (NotImplementedError: FlexAttention does not support backward on CPU); varlen calls aten::_flash_attention_forward
    (CUDA only); 0.3 refuses sdpa for its language models. 3. Its barrier after step 1 passes
    device_ids=[torch.cpu.current_device()] = ['cpu'] (TypeError in c10d). For the code path only: torch.cpu as its
    device (gloo; the memory calls of its metrics answered by zeros), set before torchtitan is imported (it reads the
    device at import); after it, the setup's stand_ins: SDPA with flex's own mask (dense) for flex, and no barrier."""
    torch._utils._get_available_device_type = lambda: "cpu"
    stubs = dict(get_device_name=lambda *a: "cpu", memory_stats=lambda *a: {}, empty_cache=lambda: None,
                 reset_peak_memory_stats=lambda *a: None,
                 get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1))  # fmt: skip
    for name, fn in stubs.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def sdpa_attend(q, k, v, *, block_mask, scale=None, enable_gqa=False, **unused):
    """CPU stand-in for torchtitan's compiled flex_attention call (q, k, v: (B, N, L, H))."""
    mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)  # (B, 1, L, L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def worker(spec: dict) -> None:
    """One torchtitan run in this fresh process (one rank) -> spec['result'] (JSON)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)  # fmt: skip
    cuda = spec["device"] == "cuda"
    if not cuda:
        cpu_shim()
    setup = importlib.import_module(spec["setup"])  # imports torchtitan: after cpu_shim
    if not cuda:
        setup.stand_ins(sdpa_attend)
    rows = json.loads(Path(spec["rows"]).read_text())
    tokens, padded = [], []

    def collate(batch: list[dict], pad_id: int = 0):
        width = spec["seq_len"] if spec["pad"] == "seq_len" else max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T) pads at position 0
        pos, labels = torch.zeros_like(ids), torch.full_like(ids, IGNORE_INDEX)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n], pos[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["position_ids"])
            labels[i, : n - 1] = ids[i, 1:n]  # the next token, across documents too (as transformers' shift)
        tokens.append(sum(len(r["input_ids"]) for r in batch))
        padded.append(ids.numel())
        return {"input": ids, "positions": pos}, labels

    trainer, info = setup.build(spec, rows, collate, LR)
    params = sum(p.numel() for p in trainer.model_parts[0].parameters())
    diff = {k: [v, SHAPES[spec["shape"]][k]] for k, v in info["shape"].items() if v != SHAPES[spec["shape"]].get(k, v)}
    if spec["shape"] in setup.SHAPED and (diff or params != hf_params(spec["shape"])):
        raise SystemExit(f"torchtitan's {setup.FLAVORS[spec['shape']]} differs from peers.py's SHAPES: {diff} "
                         f"([titan, peers]), {params} parameters vs hfpar's {hf_params(spec['shape'])}")  # fmt: skip
    records, ends = [], []

    class Capture:  # torchtitan's metric logger: each step's metrics, before MetricsProcessor.log resets the peak
        def log(self, metrics, step):
            records.append({**metrics, "peak_alloc": torch.cuda.max_memory_allocated() if cuda else 0})

        def close(self):
            pass

    trainer.metrics_processor.logger = Capture()
    step = trainer.train_step

    def timed(data_iterator):
        step(data_iterator)
        if cuda:
            torch.cuda.synchronize()
        ends.append(time.perf_counter())

    trainer.train_step = timed
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    times, w = [b - a for a, b in zip([t0, *ends[:-1]], ends)], spec["warmup"]
    result = {"tokens_per_s": statistics.mean(tokens[w : len(times)]) / statistics.median(times[w:]),
              "step_time_s": statistics.median(times[w:]), "peak_mem_bytes": max(r["peak_alloc"] for r in records),
              "compile_s": compile_seconds(), "losses": [r["loss_metrics/global_avg_loss"] for r in records],
              "grad_norms": [r["grad_norm"] for r in records], "step_times": times, "tokens": tokens[: len(times)],
              "padded_tokens": padded[: len(times)],
              "titan_tps_median": statistics.median(r["throughput(tps)"] for r in records[w:]),
              "titan_mfu": [r.get("mfu(%)") for r in records],
              "titan_max_reserved_gib": max(r["memory/max_reserved(GiB)"] for r in records),
              "params": params, "shape": info["shape"], "shape_vs_peers": diff,
              "cuda_graph": info["cuda_graph"]}  # fmt: skip
    Path(spec["result"]).write_text(json.dumps(result))


def run_variant(name: str, a, setup: str, rows: Path, logs: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"titan-{name}-"))
    spec = {"variant": name, "setup": setup, "compile_fp8": VARIANTS[name], "shape": a.shape, "device": a.device,
            "seq_len": a.seq_len, "batch": a.batch_size, "steps": a.steps, "warmup": a.warmup, "attn": a.attn,
            "pad": a.pad, "rows": str(rows), "dump": str(run_dir), "result": str(run_dir / "titan.json")}  # fmt: skip
    cmd = module_cmd("benchmarks.gpu.titan", "--worker", json.dumps(spec))
    log = logs / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        e = env(cpu=a.device == "cpu", threads=None)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=e, timeout=a.variant_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"variant": name, "error": " | ".join(log.read_text().strip().splitlines()[-3:])[-500:], "wall_s": wall}
    return {"variant": name, **json.loads((run_dir / "titan.json").read_text()), "wall_s": wall}


def table(env_: dict, results: list[dict]) -> str:
    lines = [f"{env_['gpu']}, torchtitan {env_['torchtitan']} llama3 {env_['flavor']} ({env_['params'] / 1e9:.2f}B), "
             f"rows of <= {env_['seq_len']} tokens x {env_['batch_size']} (padded to {env_['pad']}), {env_['steps']} "
             f"steps ({env_['warmup']} warm-up), {env_['attn']} attention, {env_['precision']}",
             "", f"`{env_['command']}`", "", *[f"- {n}" for n in env_["notes"]], "",
             "| variant | tokens/s | MFU | step ms | peak GiB | compile s | loss first / last | titan tps (padded) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:200]} | | | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {1e3 * r['step_time_s']:.0f} | "
            f"{r['peak_mem_bytes'] / 2**30:.1f} | {r.get('compile_s') or ''} | {r['losses'][0]:.4f} / "
            f"{r['losses'][-1]:.4f} | {r.get('titan_tps_median', float('nan')):.0f} |"
        )
    ok = {r["variant"]: r for r in results if "error" not in r}
    for v, b in (("titan", "hfpar"), ("titan_compile", "hfpar_compile"), ("titan_fp8_compile", "hfpar_fp8_compile"),
                 ("titan_fp8_compile", "hfpar_fp8_rowwise_compile"), ("titan_compile", "titan")):  # fmt: skip
        lines += ratio_lines(ok, v, b)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for titan.{json,md} and logs/ (required)")
    p.add_argument("--variants", help=f"comma separated, from {','.join(VARIANTS)} (default: {DEFAULTS})")
    p.add_argument("--shape", default="llama3_3b", choices=list(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the rates (compiles, CUDA graph capture)")
    p.add_argument("--docs", type=int, default=400, help="generated documents (peers.py's write_data)")
    p.add_argument("--attn", default="flex", choices=("flex", "varlen"), help="torchtitan's (varlen: untested)")
    p.add_argument("--pad", default="seq_len", choices=("seq_len", "longest"), help="rows padded to (see above)")
    p.add_argument("--peers", help="a peers.json of the same settings: its rows join the table")
    p.add_argument("--variant_timeout", type=float, default=300)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one torchtitan run in a fresh process (JSON spec)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    if not a.out:
        raise SystemExit("--out: required (a folder for titan.json / titan.md and logs/)")
    names = (a.variants or DEFAULTS[a.device]).split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; valid: {', '.join(VARIANTS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (--device cpu --shape tiny runs the code path)")
    if a.device == "cpu" and a.attn == "varlen":
        raise SystemExit("--attn varlen: CUDA only (torch's aten::_flash_attention_forward has no CPU kernel)")
    version, minor = setup_version()
    need, why = TORCH_NEEDS.get(minor, ((0, 0), ""))
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < need:
        raise SystemExit(f"torchtitan {minor} needs torch >= {'.'.join(map(str, need))}, here {torch.__version__} "
                         f"({why})")  # fmt: skip
    try:  # torchtitan is optional: a one-line refusal where it does not import, before any run
        setup = importlib.import_module(SETUPS[minor])
    except ImportError as e:
        raise SystemExit(
            f"torchtitan {version} does not import: {type(e).__name__}: {e} (wheels: this file's docstring)"
        ) from None
    out, logs, work = Path(a.out), Path(a.out) / "logs", Path(tempfile.mkdtemp(prefix="titan-"))
    logs.mkdir(parents=True, exist_ok=True)
    write_data(work / "docs.jsonl", a.docs)
    rows = hfpar_rows(recipe_flags(a, work / "docs.jsonl", work / "model"), a.steps, a.batch_size)
    (work / "rows.json").write_text(json.dumps(rows))
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    peak = peak_flops(gpu) if a.device == "cuda" else float("nan")
    cpu_note = ["CPU: the code path only, with stand-ins for what torchtitan lacks there (titan.py's cpu_shim)"]
    env_ = {"gpu": gpu, "shape": a.shape, "flavor": setup.FLAVORS[a.shape], "seq_len": a.seq_len,
            "batch_size": a.batch_size, "steps": a.steps, "warmup": a.warmup, "attn": a.attn, "pad": a.pad,
            "precision": PRECISION[minor], "command": command(), "torch": torch.__version__, "torchtitan": version,
            "params": 0, "notes": setup.NOTES + (cpu_note if a.device == "cpu" else [])}  # fmt: skip
    results = json.loads(Path(a.peers).read_text())["results"] if a.peers else []
    for name in names:
        print(f"[titan] {name}", flush=True)
        try:
            r = run_variant(name, a, SETUPS[minor], work / "rows.json", logs)
        except subprocess.TimeoutExpired:
            r = {"variant": name, "error": f"over --variant_timeout {a.variant_timeout} s"}
        if "error" not in r:  # peers.py's MFU: 6 N + 12 L d T FLOPs per token (N: torchtitan's params, tied once)
            s = r["shape"]
            r["flops_per_token"] = 6 * r["params"] + 12 * s["num_hidden_layers"] * s["hidden_size"] * a.seq_len
            r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
            env_["params"] = r["params"]
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("losses", "step_times", "tokens")}), flush=True)
        (out / "titan.json").write_text(json.dumps({"env": env_, "results": results}, indent=1))
        (out / "titan.md").write_text(table(env_, results))
    print((out / "titan.md").read_text())


if __name__ == "__main__":
    main()
