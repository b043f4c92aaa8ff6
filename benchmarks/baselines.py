"""hfpar's sft recipe vs the obvious alternatives on the same work, and what packing buys.

    python benchmarks/baselines.py          # one process, CPU or one GPU, fp32; ~2 minutes on 2 CPU cores

Same model (the embedded tiny Llama, same init), same tokenized data (hfpar.data on the embedded SFT
set: completion-only labels), same global batch, constant learning rate, same number of steps:
  - hfpar: `python recipes/sft.py` (its metrics.jsonl: tokens/s = real tokens / step time)
  - transformers.Trainer with the same collator
  - a minimal hand-written Accelerate loop (prepare, forward, backward, step)
tokens/s = real (non-padding) input tokens / time in the training loop; final loss = mean of the last 10
steps' losses (each framework's own loss: all three are the mean over the batch's target tokens here,
one process, no accumulation). Packing: the fraction of padding tokens per batch with and without
--packing at the same max_seq_length and batch size, and hfpar's tokens/s in both modes. Writes
benchmarks/results/baselines_<device>.{md,json}.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
BS, STEPS, LR, SEQ = 16, 60, 1e-3, 128


def dataset(packing: bool = False):
    from hfpar import data

    tok = data.load_tokenizer(None)
    ds, _ = data.tokenize_sft(data.load_splits(None, "sft")["train"], tok, SEQ)
    return (data.pack(ds, SEQ) if packing else ds), tok, data.DataCollator(tok, task="lm")


def fresh_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar import data

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))


def run_hfpar(packing: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix="hfpar-base-"))
    cmd = [sys.executable, str(ROOT / "recipes" / "sft.py"), "--output_dir", str(out), "--max_steps", str(STEPS),
           "--per_device_train_batch_size", str(BS), "--learning_rate", str(LR), "--lr_scheduler_type", "constant",
           "--warmup_steps", "0", "--eval_steps", "0", "--logging_steps", "1000", "--max_grad_norm", "0",
           "--max_seq_length", str(SEQ), "--save_final_model", "false", *(["--packing"] if packing else [])]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps)
    return {"tokens_per_s": tokens / sum(r["step_time_s"] for r in steps),
            "final_loss": statistics.mean(r["loss"] for r in steps[-10:])}


def _tokens(ds, n_samples: int) -> int:
    return sum(len(ds[i]["input_ids"]) for i in range(n_samples))


def run_trainer() -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ds, tok, collate = dataset()
    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BS, max_steps=STEPS,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                             save_strategy="no", report_to="none", max_grad_norm=0.0, dataloader_num_workers=0,
                             use_cpu=not torch.cuda.is_available(), seed=42, remove_unused_columns=False,
                             disable_tqdm=True)
    trainer = Trainer(model=fresh_model(), args=args, train_dataset=ds, data_collator=collate, callbacks=[Losses()])
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": _tokens(ds, BS * STEPS) / dt, "final_loss": statistics.mean(losses[-10:]),
            "note": "tokens estimated as the first BS*STEPS samples' lengths (the sampler shuffles)"}


def run_accelerate_loop() -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    ds, tok, collate = dataset()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(42)
    model = fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    loader = DataLoader(ds, batch_size=BS, shuffle=True, collate_fn=collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    model.train()
    losses, tokens = [], 0
    t0 = time.perf_counter()
    it = iter(loader)
    for _ in range(STEPS):
        batch = next(it)
        tokens += int(batch["attention_mask"].sum())
        loss = model(**batch, use_cache=False).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "final_loss": statistics.mean(losses[-10:])}


def padding_fraction(packing: bool) -> float:
    """Padding tokens / all tokens over the first 50 batches, rows padded to the batch's longest (the collator)."""
    ds, _, _ = dataset(packing)
    real = total = 0
    for i in range(0, min(len(ds), BS * 50), BS):
        lengths = [len(ds[j]["input_ids"]) for j in range(i, min(i + BS, len(ds)))]
        real += sum(lengths)
        total += len(lengths) * max(lengths)
    return 1 - real / total


def main() -> None:
    res = {"hfpar sft recipe": run_hfpar(False), "transformers Trainer": run_trainer(),
           "hand-written Accelerate loop": run_accelerate_loop()}
    pack = {"no packing": {"padding_fraction": padding_fraction(False), **run_hfpar(False)},
            "--packing": {"padding_fraction": padding_fraction(True), **run_hfpar(True)}}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {"command": "python " + " ".join(sys.argv), "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "batch": BS, "steps": STEPS, "lr": LR, "max_seq_length": SEQ}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"baselines_{dev}.json").write_text(json.dumps({"meta": meta, "frameworks": res, "packing": pack}, indent=2))
    lines = [f"# hfpar vs transformers.Trainer vs a plain Accelerate loop ({dev}, one process, fp32)", "",
             f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}. Embedded "
             f"tiny Llama and SFT data, batch {BS}, {STEPS} steps, constant lr {LR}, max_seq_length {SEQ}.", "",
             "| run | tokens/s | loss (mean of last 10 steps) |", "|---|---|---|"]
    lines += [f"| {k} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |" for k, v in res.items()]
    lines += ["", "Packing (hfpar sft recipe, same batch and max_seq_length):", "",
              "| mode | padding tokens per batch | tokens/s (real tokens) | loss (last 10) |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['padding_fraction']:.1%} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |"
              for k, v in pack.items()]
    (RESULTS / f"baselines_{dev}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
