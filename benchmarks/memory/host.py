"""Host memory per rank: loading a real-size model under each sharded strategy, and the LM loss's peak.

    python -m benchmarks.memory.host                   # both sections; writes results/memory/host_cpu.{json,md,png}
    python -m benchmarks.memory.host --sections load   # one section (the other is kept from host_cpu.json)

Takes about 7 minutes on 2 idle CPU cores (measured: load 4.6, loss 1.8; 13.8 for load on busy cores; `minutes` in the
JSON).

load: a random-init Llama of 233M parameters (hidden 1024, 10 layers, intermediate 4096, vocab 32000, untied;
932 MB fp32), built from a config and saved as safetensors by this script (nothing downloaded). The issue asked for
~0.5B; one FSDP2 AdamW step of 0.47B at 2 or 4 processes would peak at ~18-19 GB of host memory (37 bytes per
parameter across the ranks in tests/launch/test_loading_recipe.py's 106M run, plus ~0.5 GB start-up per process), more
than this shared 24 GB machine can spare, hence the smaller model (the loading figures scale with it). The sft recipe,
fp32, 1 optimizer step, batch 1 x 32 tokens, no eval, no checkpoints, no export, one launch at a time, at 1 / 2 / 4
processes under
  fsdp2.yaml      sharded: each rank reads its FSDP2 dim-0 shards (and --sharded_loading false at 2)
  zero3.yaml      from_pretrained under DeepSpeed's zero.Init (partitioned as it loads)
  tp2             2 processes: ddp.yaml --tp_size 2 (pure TP); 4: fsdp2.yaml --tp_size 2 (TP=2 x FSDP2 dp=2: under
                  ddp.yaml each of the 4 ranks would hold half the model and its full Adam state, ~16 GB in all);
                  --sharded_loading false at 2
Per rank, from run_info.json: the peak RSS once the model is loaded and wrapped (`host_peak_rss_after_load`) and
over the run (`host_peak_rss`), each also minus the same launch with the tiny model (the process's start-up
peak); tokens/s of the step. A watchdog stops a launch whose process tree passes --max_rss_gib (recorded).

loss: benchmarks/memory/loss.py's measurement (each case in a fresh process) over vocab 32k / 128k / 152k and 4k
to 32k tokens: its committed rows (loss_cpu.json: 32k x 4k / 8k, 128k x 4k / 8k, 152k x 4k) plus the cases
it lacks (32k x 16k, 32k x 32k) measured here with its code; the unchunked logits path only where it fits under
UNCHUNKED_CAP (~3 x N x V x 4 bytes; every case here does: 32k x 32k measured 11.8 GiB), the chunked one
everywhere. More tokens at 128k+ vocab are not in the grid: the unchunked path would need 15-28 GiB (152k x 8k and
up), more than this machine has, and the chunked one runs at ~500 tokens/s there on 2 cores (minutes per case).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.common.launch import ROOT, accelerate_cmd, env, module_cmd, results_dir
from benchmarks.memory import loss as loss_memory
from hfpar.observe.plot import human_bytes

RESULTS = results_dir("memory")
MODEL = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    tie_word_embeddings=False,
)
FLAGS = [
    "--max_steps",
    "1",
    "--eval_steps",
    "0",
    "--save_final_model",
    "false",
    "--max_seq_length",
    "32",
    "--per_device_train_batch_size",
    "1",
    "--logging_steps",
    "1",
]
# (strategy, processes, accelerate config, extra flags, sharded loading)
LOAD_CASES = (
    [("fsdp2", n, "fsdp2", [], True) for n in (1, 2, 4)]
    + [("zero3", n, "zero3", [], True) for n in (1, 2, 4)]
    + [("tp2", 2, "ddp", ["--tp_size", "2"], True), ("tp2", 4, "fsdp2", ["--tp_size", "2"], True)]
    + [("fsdp2", 2, "fsdp2", [], False)]
    + [("tp2", 2, "ddp", ["--tp_size", "2"], False)]
)
TOKENS = (4096, 8192, 16384, 32768)
LOSS_CASES = [(32_000, n) for n in TOKENS] + [(128_256, n) for n in TOKENS[:2]] + [(151_936, 4096)]
UNCHUNKED_CAP = 12 * 2**30  # bytes: the 128k x 8k case (11.8 GiB measured) is the largest that fits here


def build(path: Path, config: dict) -> int:
    """Save a random-init Llama of `config` (+ the repo's tokenizer) in a child process -> its parameter count. Not
    here: a child's ru_maxrss starts at its parent's peak RSS (Linux keeps it across fork and exec), and the loss
    cases run as children of this process."""
    out = subprocess.run(
        module_cmd("benchmarks.memory.host", "--build", path, json.dumps(config)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def _build_here(path: str, config: dict) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfpar import data

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(path)
    data.load_tokenizer(None).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _tree_rss(proc: psutil.Process) -> int:
    """RSS of the launcher and its descendants (0 for any that exits while they are counted)."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def launch(config: str, n: int, flags: list[str], model: Path, out: Path, max_rss: int) -> dict:
    """One launch, its process tree's RSS polled every 0.2 s (stopped above max_rss) -> run_info + step record."""
    cmd = accelerate_cmd(
        config, n, "sft", [*FLAGS, *flags, "--model_name_or_path", str(model), "--output_dir", str(out)]
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, over = 0, False
    watched = psutil.Process(proc.pid)

    def watch():
        nonlocal peak, over
        while proc.poll() is None:
            peak = max(peak, _tree_rss(watched))
            if peak > max_rss and not over:
                over = True
                for p in watched.children(recursive=True):
                    p.kill()
                proc.kill()
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    log, _ = proc.communicate()
    t.join()
    if over:
        return {"error": f"stopped: process tree above {human_bytes(max_rss)}", "tree_peak_bytes": peak}
    if proc.returncode != 0:
        return {"error": log.strip().splitlines()[-1] if log.strip() else f"exit {proc.returncode}"}
    info = json.loads((out / "run_info.json").read_text())
    step = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][0]
    return {
        "load": info["host_peak_rss_after_load_bytes_per_rank"],
        "run": info["host_peak_rss_bytes_per_rank"],
        "param_bytes": info["param_bytes_per_rank"],
        "mode": info["loading"]["mode"],
        "tokens_per_s": step["tokens_per_s"],
        "tree_peak_bytes": peak,
    }


def load_section(max_rss: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = build(tmp / "model", MODEL)
        tiny = dict(
            MODEL,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=1024,
        )
        build(tmp / "tiny", tiny)
        baselines = {}
        for i, (name, n, config, flags, sharded) in enumerate(tqdm(LOAD_CASES, desc="load", unit="launch")):
            extra = [*flags, *([] if sharded else ["--sharded_loading", "false"])]
            key = (config, n, tuple(flags))
            if key not in baselines:
                baselines[key] = launch(config, n, flags, tmp / "tiny", tmp / f"tiny{i}", max_rss)
            got = launch(config, n, extra, tmp / "model", tmp / f"run{i}", max_rss)
            base = baselines[key]
            row = {"strategy": name, "processes": n, "config": config, "flags": extra, "sharded": sharded, **got}
            if "error" not in got and "error" not in base:
                row["load_minus_tiny"] = [a - b for a, b in zip(got["load"], base["load"])]
                row["run_minus_tiny"] = [a - b for a, b in zip(got["run"], base["run"])]
            tqdm.write(
                f"{name} x{n} {got.get('mode', 'sharded' if sharded else 'full')}: "
                + (
                    got.get("error")
                    or f"load {[human_bytes(b) for b in got['load']]}, run {[human_bytes(b) for b in got['run']]}"
                )
            )
            rows.append(row)
    return {
        "model": MODEL,
        "num_parameters": n_params,
        "model_fp32_bytes": 4 * n_params,
        "flags": FLAGS,
        "tiny_model": tiny,
        "rows": rows,
    }


def loss_section() -> dict:
    """loss_cpu.json's rows (benchmarks/memory/loss.py, same measurement) plus the LOSS_CASES it lacks,
    measured now with its code; each row says which run it comes from."""
    prior = json.loads((RESULTS / "loss_cpu.json").read_text())
    assert prior["hidden"] == loss_memory.H, "rerun benchmarks/memory/loss.py first (hidden size changed)"
    rows = [dict(r, source="loss_cpu.json") for r in prior["rows"]]
    have, capped = {(r["vocab"], r["tokens"]) for r in rows}, []
    todo = [c for c in LOSS_CASES if c not in have]
    for v, n in tqdm(todo, desc="loss", unit="case"):
        rows.append(dict(loss_memory.run("chunked", v, n), source="host.py"))
        if 3 * n * v * 4 <= UNCHUNKED_CAP:
            rows.append(dict(loss_memory.run("unchunked", v, n), source="host.py"))
        else:
            capped.append([v, n])
    rows.sort(key=lambda r: (r["vocab"], r["tokens"]))
    return {"hidden": loss_memory.H, "unchunked_cap_bytes": UNCHUNKED_CAP, "capped": capped, "rows": rows}


def _mb_list(values) -> str:
    return " / ".join(human_bytes(v) for v in values)


def report(res: dict) -> str:
    lines = ["# Host memory per rank (CPU, fp32)", ""]
    if "load" in res:
        ld = res["load"]
        lines += [
            f"## Loading and one step of a {ld['num_parameters'] / 1e6:.0f}M-parameter Llama "
            f"({human_bytes(ld['model_fp32_bytes'])} fp32)",
            "",
            "`python -m benchmarks.memory.host --sections load`: per rank (rank 0 / 1 / ...), peak RSS once the model"
            " is loaded and wrapped, and over the whole run (1 AdamW step); each minus the same launch with a "
            "tiny model (start-up). `x model` = the largest rank's load figure over the model's fp32 bytes.",
            "",
            "| strategy | processes | loading | load peak | load - tiny | x model | run peak | run - tiny | tokens/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in ld["rows"]:
            cmd = " ".join([f"{r['config']}.yaml", *r["flags"]])
            head = f"| {r['strategy']} (`{cmd}`) | {r['processes']} |"
            if "error" in r:
                lines.append(f"{head} - | {r['error']} | | | | | |")
                continue
            x = max(r["load_minus_tiny"]) / ld["model_fp32_bytes"]
            lines.append(
                f"{head} {r['mode']} | {_mb_list(r['load'])} | {_mb_list(r['load_minus_tiny'])} | {x:.2f} |"
                f" {_mb_list(r['run'])} | {_mb_list(r['run_minus_tiny'])} | {r['tokens_per_s']:.0f} |"
            )
        lines.append("")
    if "loss" in res:
        ls = res["loss"]
        lines += [
            "## LM head + cross-entropy: chunked vs unchunked",
            "",
            f"`python -m benchmarks.memory.host --sections loss` (benchmarks/memory/loss.py's measurement): hidden "
            f"{ls['hidden']}, forward + backward of the summed loss, peak RSS above the inputs, median of 3. "
            f"Unchunked only where ~3 x N x V x 4 bytes <= {human_bytes(ls['unchunked_cap_bytes'])}; capped "
            f"(not run, would not fit this 24 GB shared machine): "
            + (", ".join(f"V={v} x N={n}" for v, n in ls["capped"]) or "none of the cases here")
            + ".",
            "",
            "| vocab | tokens | unchunked peak | chunked peak | ratio | unchunked tok/s | chunked tok/s | run |",
            "|---|---|---|---|---|---|---|---|",
        ]
        by = {(r["mode"], r["vocab"], r["tokens"]): r for r in ls["rows"]}
        for v, n in dict.fromkeys((r["vocab"], r["tokens"]) for r in ls["rows"]):
            c, u = by[("chunked", v, n)], by.get(("unchunked", v, n))
            lines.append(
                f"| {v} | {n} | {human_bytes(u['peak_bytes']) if u else 'capped'} | "
                f"{human_bytes(c['peak_bytes'])} | {c['peak_bytes'] / u['peak_bytes']:.2f} | "
                f"{u['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} | {c['source']} |"
                if u
                else f"| {v} | {n} | capped | {human_bytes(c['peak_bytes'])} | | | {c['tokens_per_s']:.0f} |"
                f" {c['source']} |"
            )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    if "load" in res:
        ld = res["load"]
        gib = ld["model_fp32_bytes"] / 2**30
        for ax, field, title in (
            (axes[0], "load", "peak RSS once loaded (max over ranks)"),
            (axes[1], "run", "peak RSS over the run, 1 AdamW step"),
        ):
            for sharded, style in ((True, "-o"), (False, "--x")):
                for name in dict.fromkeys(r["strategy"] for r in ld["rows"]):
                    pts = [
                        (r["processes"], max(r[field]) / 2**30)
                        for r in ld["rows"]
                        if r["strategy"] == name and r["sharded"] == sharded and "error" not in r
                    ]
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{name}{'' if sharded else ' --sharded_loading false'}")
            ax.axhline(gib, color="grey", lw=0.8, ls=":", label=f"model fp32 ({gib:.2f} GiB)")
            ax.set_xticks([1, 2, 4])
            ax.set_xlabel("processes")
            ax.set_ylabel("GiB per rank")
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=7)
    if "loss" in res:
        loss_memory.draw(axes[2], res["loss"]["rows"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="load,loss", help="comma separated: load, loss")
    p.add_argument("--max_rss_gib", type=float, default=14.0, help="stop a launch whose process tree passes this")
    p.add_argument("--build", nargs=2, metavar=("PATH", "CONFIG_JSON"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build:
        print(_build_here(a.build[0], json.loads(a.build[1])))
        return
    path = RESULTS / "host_cpu.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    for section in a.sections.split(","):
        t0 = time.perf_counter()
        res[section] = load_section(int(a.max_rss_gib * 2**30)) if section == "load" else loss_section()
        res[section]["minutes"] = round((time.perf_counter() - t0) / 60, 1)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "host_cpu.md").write_text(report(res))
    plot(res, RESULTS / "host_cpu.png")
    print(report(res))


if __name__ == "__main__":
    main()
