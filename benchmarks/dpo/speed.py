"""DPO throughput: hfpar's dpo recipe vs TRL 1.16's DPOTrainer, side by side, on the same model, pairs and
batches (the reference model a separate frozen copy in both), checking that the per-step losses agree before
comparing speed. CPU (fp32, the committed default) or one CUDA GPU (bf16 autocast over fp32 weights in both:
hfpar's --mixed_precision bf16, TRL's bf16=True).

    python -m benchmarks.dpo.speed                    # -> benchmarks/results/dpo/speed_cpu.json / .md
    python -m benchmarks.dpo.speed --steps 12 --rounds 3
    python -m benchmarks.dpo.speed --device cuda --dtype bfloat16 --out DIR    # -> DIR/speed_cuda.json / .md (~1-2 min)
                                                                                #  + DIR/profile_cuda.md / .json
On CUDA (or with --profile) the same run then profiles a few steps of hfpar and of TRL (benchmarks/dpo/profile.py:
device busy time, launches, host syncs, hfpar's phases, an SDPA check of the packed rows' mask) ->
DIR/profile_<device>.md / .json and hfpar's chrome trace; --no-profile skips it.

CPU: a 256-wide, 4-layer Llama on the embedded pairs (short: ~30 tokens). GPU (defaults of --device cuda): a
1024-wide, 8-layer Llama with a 32000 vocabulary on pairs of --seq tokens per sequence (--prompt_len of them the
prompt: the embedded task's prompt and completions lengthened with random words), built from a config (no
downloads).

pairs/s: the pairs of the steps after the first (warm-up: allocation, lazy init, kernels), over their wall time
(CUDA synchronized at both ends), and per CPU-second of the process (all threads; on a shared machine the
steadier of the two), median over rounds, hfpar and TRL interleaved (the machine is shared: interleaving spreads
its noise over both). Peak memory: on CPU the process's peak RSS growth during the training call (ru_maxrss is per
process and only grows: each trainer runs in a fresh subprocess), on CUDA torch.cuda.max_memory_allocated over the
run (model, reference, optimizer state, activations). TRL is run twice: with its 1.16 defaults
(gradient_checkpointing on) and with gradient_checkpointing off (hfpar's default; TRL's fastest setting here: its
padding_free needs FlashAttention and its Liger kernels are deprecated and not installed), so the comparison is
against both. Both compute the per-token log-probs their own way (TRL: its chunked fused LM head; hfpar: logits,
with each pair's prompt computed once, hfpar.data.preference.PairCollator share_prompt). CPU runs use one thread
(torch.set_num_threads(1)): on a shared 2-core machine more threads only spin. Losses: fp32 runs agree within
1e-4 relative; bf16 runs differ by bf16 rounding (reported, not asserted: two implementations round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import string
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.launch import ROOT, command, module_cmd, results_dir
from benchmarks.dpo.trl_compare import make_case, run_hfpar, run_trl
from hfpar.data.preference import make_preference
from hfpar.train.trainer import Trainer

CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
GPU = {
    "hidden": 1024,
    "layers": 8,
    "vocab": 32000,
    "seq": 512,
    "prompt_len": 384,
    "steps": 30,
    "batch": 16,
    "rounds": 1,
}
CPU = {"hidden": 256, "layers": 4, "vocab": None, "seq": None, "prompt_len": None, "steps": 10, "batch": 8, "rounds": 2}


def model_config(hidden: int, layers: int, vocab: int | None, seq: int | None) -> dict:
    """A Llama shape of `hidden` width (head_dim 64 above 256 wide, 32 below; GQA 2:1; MLP 2.75x)."""
    if hidden == CONFIG["hidden_size"] and layers == CONFIG["num_hidden_layers"] and vocab is None:
        return dict(CONFIG)
    head = 64 if hidden > 256 else 32
    cfg = {
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 2.75) // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // head,
        "num_key_value_heads": max(1, hidden // head // 2),
        "head_dim": head,
    }
    if vocab:
        cfg["vocab_size"] = vocab  # the embedded tokenizer's 128 ids use the first rows: the LM head's cost is real
    if seq:
        cfg["max_position_embeddings"] = max(512, 2 * seq)
    return cfg


def long_pairs(n: int, seq: int, prompt_len: int, seed: int = 7) -> list[dict]:
    """The embedded pairs lengthened to ~seq tokens per sequence (the embedded tokenizer: one token per character):
    random words before the prompt's question, after each completion (different for chosen and rejected)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        out = []
        while sum(len(w) + 1 for w in out) < k:
            out.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))))
        return " ".join(out)[:k]

    rows = make_preference(seed, n_train=n, n_eval=1)["train"].to_list()
    for r in rows:
        q = r["prompt"][-1]["content"]
        r["prompt"][-1]["content"] = words(max(0, prompt_len - len(q) - 24)) + " " + q
        for side in ("chosen", "rejected"):
            a = r[side][0]["content"]
            r[side][0]["content"] = a + " " + words(max(0, seq - prompt_len - len(a) - 8))
    return rows


def one(kind: str, model: str, data: str, opts: dict) -> dict:
    """One training run in this process -> {pairs_per_s, pairs_per_cpu_s, peak memory, losses}."""
    out, device, bf16 = tempfile.mkdtemp(), opts["device"], opts["dtype"] == "bfloat16"
    steps, batch, max_length = opts["steps"], opts["batch"], opts["max_length"]
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if bf16 else "no"
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    warm = 1  # steps left out: the first (allocation, lazy init)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if kind == "hfpar":
        wall, cpu = [], []  # wall and CPU-seconds (all threads of the process) of each optimizer step
        step = Trainer._train_step

        def timed(self, i, loaded, t0, c0):
            # from when the loop asked for the step's batches (hfpar.train.trainer._loop): waiting for them counts
            rec = step(self, i, loaded, t0, c0)
            sync()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            return rec

        Trainer._train_step = timed
        extra = opts.get("hfpar_extra") or None
        recs = run_hfpar(model, data, out, steps=steps, batch=batch, max_length=max_length, extra=extra)
        Trainer._train_step = step
        # compiled, also every step that compiled (metrics' compile_s grew: new row lengths, the reference's
        # no-grad graphs, a dynamic batch dimension: dynamo recompiles a few times in the first steps)
        spent = [r.get("compile_s", 0.0) for r in recs if "step_time_s" in r]
        keep = [i for i in range(1, len(wall)) if i >= len(spent) or spent[i] <= spent[i - 1]]
        warm = len(wall) - len(keep)
        wall_s, cpu_s = sum(wall[i] for i in keep), sum(cpu[i] for i in keep)
    else:
        timing = {}
        recs = run_trl(
            model,
            data,
            out,
            steps=steps,
            batch=batch,
            max_length=max_length,
            timing=timing,
            gradient_checkpointing=kind == "trl_default",
            device=device,
            bf16=bf16,
        )
        wall_s, cpu_s = timing["steady_s"], timing["steady_cpu_s"]
    res = {
        "pairs_per_s": (steps - warm) * batch / wall_s,
        "pairs_per_cpu_s": (steps - warm) * batch / cpu_s,
        "losses": [r["loss"] for r in recs],
    }
    if device == "cuda":
        res["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        res["peak_mem_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="float32 (CPU default) or bfloat16 autocast over fp32 weights (CUDA default)",
    )
    ap.add_argument("--out", default=None, help="directory of dpo_<device>.json / .md (default benchmarks/results)")
    for k in ("hidden", "layers", "vocab", "seq", "prompt_len", "steps", "batch", "rounds"):
        ap.add_argument(f"--{k}", type=int, default=None, help=f"CPU default {CPU[k]}, CUDA default {GPU[k]}")
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile a few steps of hfpar and TRL after the timed runs (default: on CUDA only)",
    )
    ap.add_argument(
        "--hfpar_extra",
        default="",
        help='options added to hfpar\'s dpo recipe, e.g. --hfpar_extra="--torch_compile" (results: speed_<device>_'
        "compile.*)",
    )
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # kind model data opts-json: a child run
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one[0], a.one[1], a.one[2], json.loads(a.one[3]))))
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    d = GPU if a.device == "cuda" else CPU
    o = {k: getattr(a, k) if getattr(a, k) is not None else d[k] for k in d}
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    config = model_config(o["hidden"], o["layers"], o["vocab"], o["seq"])
    opts = {
        "device": a.device,
        "dtype": dtype,
        "steps": o["steps"],
        "batch": o["batch"],
        "max_length": 2 * o["seq"] if o["seq"] else 128,
        "hfpar_extra": a.hfpar_extra.split(),
    }
    root = Path(tempfile.mkdtemp())
    n = o["steps"] * o["batch"]
    rows = long_pairs(n, o["seq"], o["prompt_len"]) if o["seq"] else None
    model, data = make_case(root, pairs=n, config_updates=config, rows=rows)
    kinds = ("hfpar", "trl_default", "trl_no_gc")
    runs = {k: [] for k in kinds}
    t0 = time.perf_counter()
    for _ in range(o["rounds"]):
        for k in kinds:
            proc = subprocess.run(
                module_cmd("benchmarks.dpo.speed", "--one", k, model, data, json.dumps(opts)),
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=False,
            )
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"{k} failed:\n{proc.stderr[-3000:]}")
            runs[k].append(json.loads(line[0][7:]))
    ref = runs["trl_default"][0]["losses"]
    worst = max(abs(x - y) / abs(y) for r in runs.values() for run in r for x, y in zip(run["losses"], ref))
    summary = {
        k: {m: statistics.median(r[m] for r in v) for m in ("pairs_per_s", "pairs_per_cpu_s", "peak_mem_mib")}
        for k, v in runs.items()
    }
    hf = summary["hfpar"]
    result = {
        "device": a.device,
        "dtype": dtype,
        "model": config,
        "steps": o["steps"],
        "pairs_per_step": o["batch"],
        "tokens_per_sequence": o["seq"],
        "prompt_tokens": o["prompt_len"],
        "rounds": o["rounds"],
        "max_rel_loss_diff_vs_trl": worst,
        "summary": summary,
        "runs": runs,
        **{
            f"{w}speedup_vs_{k}": hf[f"pairs_per_{u}"] / summary[k][f"pairs_per_{u}"]
            for w, u in (("", "s"), ("cpu_", "cpu_s"))
            for k in ("trl_default", "trl_no_gc")
        },
        "machine": (
            torch.cuda.get_device_name()
            if a.device == "cuda"
            else f"{platform.machine()}, {os.cpu_count()} CPUs (shared)"
        ),
        "torch": torch.__version__,
        "bench_wall_s": round(time.perf_counter() - t0, 1),
        "command": command(),
    }
    out = Path(a.out) if a.out else results_dir("dpo")
    out.mkdir(parents=True, exist_ok=True)
    mem = "peak GPU memory allocated (MiB)" if a.device == "cuda" else "peak RSS growth (MiB)"
    lines = [f"| trainer | pairs/s (wall) | pairs per CPU-s | {mem} |", "|---|---|---|---|"]
    lines += [
        f"| {k} | {v['pairs_per_s']:.2f} | {v['pairs_per_cpu_s']:.2f} | {v['peak_mem_mib']:.0f} |"
        for k, v in summary.items()
    ]
    shape = f"{o['seq']} tokens per sequence ({o['prompt_len']} prompt)" if o["seq"] else "the embedded pairs"
    md = (
        f"# DPO: hfpar vs TRL 1.16 DPOTrainer ({result['machine']}, {dtype}, one process)\n\n`{result['command']}`; "
        f"model {config}; {shape}; {o['steps']} steps x {o['batch']} pairs, median of {o['rounds']} interleaved "
        f"round(s); per-step losses agree within {worst:.1e} relative.\n\n"
        + "\n".join(lines)
        + f"\n\nhfpar / TRL, wall (CPU): {result['speedup_vs_trl_default']:.2f}x "
        f"({result['cpu_speedup_vs_trl_default']:.2f}x) against TRL's defaults (gradient checkpointing on), "
        f"{result['speedup_vs_trl_no_gc']:.2f}x ({result['cpu_speedup_vs_trl_no_gc']:.2f}x) against TRL with "
        "gradient checkpointing off\n"
    )
    tag = "".join("_" + x.lstrip("-").replace("torch_", "") for x in opts["hfpar_extra"] if x.startswith("--"))
    name = f"speed_{a.device}{tag}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
    print(md)
    if a.profile or (a.profile is None and a.device == "cuda"):
        profiled(model, data, opts, out, f"profile_{a.device}{tag}", result["command"])


def profiled(model: str, data: str, opts: dict, out: Path, name: str, command: str) -> None:
    """benchmarks/dpo/profile.py for hfpar and TRL (fresh processes) -> out/<name>.md / .json."""
    res = {}
    for kind in ("hfpar", "trl"):
        proc = subprocess.run(
            module_cmd(
                "benchmarks.dpo.profile", model, data, json.dumps(opts), out, *([kind] if kind == "trl" else [])
            ),
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        res[kind] = json.loads(line[0][7:]) if line else {"summary": {"failed": proc.stderr[-3000:]}, "tables": ""}
    (out / f"{name}.json").write_text(json.dumps({k: v["summary"] for k, v in res.items()}, indent=1) + "\n")
    hf, trl = res["hfpar"]["summary"], res["trl"]["summary"]
    keys = (
        "wall_ms",
        "device_busy_ms",
        "device_ms_by_ops",
        "sync_wait_ms",
        "kernel_launches",
        "device_to_host_copies",
        "host_to_device_copies",
        "sdpa_kernels_per_step",
        "phase_device_spans_ms",
    )
    rows = [f"| {k} | {hf.get(k, '-')} | {trl.get(k, '-')} |" for k in keys]
    phases = [f"| {k} | {v} |" for k, v in hf.get("host_phases_ms", {}).items()]
    att = hf.get("attention_check", {})
    md = (
        f"# Where a DPO step's time goes (`{command}`)\n\nPer step, steps 4-6 of {opts['batch']} pairs "
        "(benchmarks/dpo/profile.py; torch.profiler):\n\n| per step | hfpar | TRL (no gradient checkpointing) |\n"
        "|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nhfpar's phases, host ms per step under the profiler (inclusive; indented: inside before_micro; "
        "not synchronized, so a phase holds any wait of its own host syncs):\n\n| phase | ms |\n|---|---|\n"
        + "\n".join(phases)
        + f"\n\nSDPA forward + backward on one batch's shapes (ms): {json.dumps(att)}\n\n"
        + "".join(
            f"## {k} ops\n\n```\n{v['tables']}\n```\n\n"
            if v["tables"]
            else f"## {k}: failed\n\n```\n{v['summary'].get('failed', '')}\n```\n\n"
            for k, v in res.items()
        )
    )
    (out / f"{name}.md").write_text(md)
    print("\n".join(md.split("\n")[:30]))


if __name__ == "__main__":
    main()
