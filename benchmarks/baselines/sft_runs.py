"""The runs of benchmarks/baselines/sft.py's frameworks and packing sections: hfpar's recipe, HF Trainer and a plain
Accelerate loop on the same model and data, each timed the same way.

    rec = run_hfpar(["--packing"], steps=20)         # tokens/s, loss of the recipe in a fresh process
    rec = run_trainer(20); rec = run_accelerate_loop(20)
    padding_fraction("padded")                       # the share of padding tokens in the batches
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.launch import ROOT, env

BS, STEPS, LR, SEQ, SEED = 16, 60, 1e-3, 128, 42


def hfpar_cases() -> dict:
    from hfpar.config import RecipeArgs

    cases = {"hfpar (default)": [], "hfpar --packing": ["--packing"]}
    if "padding_free" in {f.name for f in dataclasses.fields(RecipeArgs)}:  # padded batches, once not the default
        cases["hfpar --padding_free false"] = ["--padding_free", "false"]
    return cases


def dataset(packing: bool = False):
    from hfpar import data

    tok = data.load_tokenizer(None)
    ds, _ = data.tokenize_sft(data.load_splits(None, "sft")["train"], tok, SEQ)
    return (data.pack(ds, SEQ) if packing else ds), tok, data.DataCollator(tok, task="lm")


def fresh_model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpar import data

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))


def recipe_rows(flags: list[str], steps: int, batch: int = BS) -> tuple:
    """(train dataset, per-step row indices) exactly as `recipes/sft.py <flags>` builds and samples them (one
    process, `batch` rows a step)."""
    from types import SimpleNamespace

    from hfpar import data, recipes
    from hfpar.config import parse_args
    from hfpar.train.sampler import GlobalBatchSampler

    recipe = recipes.get("sft")
    args = parse_args(
        flags, recipe="sft", defaults=dict(recipe.defaults), demo=dict(recipe.demo), args_class=recipe.args_class
    )
    one_process = SimpleNamespace(seq_multiple=1)  # the data builder's view of the context and run plan
    plan = SimpleNamespace(task="lm", padding_free=False, one_row=False, image_text=False)  # the text data builder
    train, *_ = recipe.build_data(args, data.load_tokenizer(args.tokenizer_path), one_process, plan)
    sampler = GlobalBatchSampler(len(train), batch, 1, 0, 1, args.seed)
    return train, [[i for ix in micro for i in ix] for _, _, micro in sampler.iterate(0, steps)]


def _rate(tokens: list[int], times: list[float]) -> float:
    """Real tokens / time over the steps after the first (warm-up: allocations, lazy initialization)."""
    return sum(tokens[1:]) / sum(times[1:]) if len(tokens) > 1 else sum(tokens) / sum(times)


def run_hfpar(flags: list[str], steps: int, max_grad_norm: str = "0") -> dict:
    out = Path(tempfile.mkdtemp(prefix="hfpar-base-"))
    common = [
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(BS),
        "--learning_rate",
        str(LR),
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "0",
        "--warmup_ratio",
        "0",
        "--max_grad_norm",
        max_grad_norm,
        "--max_seq_length",
        str(SEQ),
        "--seed",
        str(SEED),
    ]
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "sft.py"),
        "--output_dir",
        str(out),
        *common,
        "--eval_steps",
        "0",
        "--logging_steps",
        "1000",
        "--save_final_model",
        "false",
        *flags,
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env(cpu=False, threads=None))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_ = [r for r in rows if "loss" in r]
    train, per_step = recipe_rows(common + flags, steps)
    tokens = [sum(len(train[i]["input_ids"]) for i in ix) for ix in per_step]
    return {
        "tokens_per_s": _rate(tokens, [r["step_time_s"] for r in steps_]),
        "final_loss": statistics.mean(r["loss"] for r in steps_[-10:]),
        "losses": [r["loss"] for r in steps_],
    }


def _tokens(ds, n_samples: int) -> int:
    return sum(len(ds[i]["input_ids"]) for i in range(n_samples))


def run_trainer(steps: int) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ds, _, collate = dataset()
    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=BS,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        max_grad_norm=0.0,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        seed=SEED,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=fresh_model(), args=args, train_dataset=ds, data_collator=collate, callbacks=[Losses()])
    t0 = time.perf_counter()
    trainer.train()
    dt = time.perf_counter() - t0
    return {
        "tokens_per_s": _tokens(ds, BS * steps) / dt,
        "final_loss": statistics.mean(losses[-10:]),
        "note": "tokens estimated as the first batch x steps samples' lengths (the sampler shuffles)",
    }


def run_accelerate_loop(steps: int) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    ds, _, collate = dataset()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(SEED)
    model = fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    loader = DataLoader(ds, batch_size=BS, shuffle=True, collate_fn=collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    model.train()
    losses, tokens = [], 0
    t0 = time.perf_counter()
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        tokens += int(batch["attention_mask"].sum())
        loss = model(**batch, use_cache=False).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "final_loss": statistics.mean(losses[-10:])}


def padding_fraction(mode: str) -> float:
    """Padding tokens / all tokens over the first 50 batches in the collator's layout: `padded` rows padded to the
    batch's longest sample, `padding_free` the batch's samples packed first-fit-decreasing into rows of at most
    max_seq_length padded to the longest row (the default), `packing` the packed dataset's rows, `one_row` a batch
    in one row (hfpar_varlen: none)."""
    from hfpar.data.collate import first_fit_decreasing

    ds, _, _ = dataset(mode == "packing")
    real = total = 0
    for i in range(0, min(len(ds), BS * 50), BS):
        lengths = [len(ds[j]["input_ids"]) for j in range(i, min(i + BS, len(ds)))]
        real += sum(lengths)
        if mode == "one_row":
            total += sum(lengths)
        elif mode == "padding_free":
            rows = [sum(lengths[k] for k in row) for row in first_fit_decreasing(lengths, SEQ)]
            total += len(rows) * max(rows)
        else:
            total += len(lengths) * max(lengths)
    return 1 - real / total
