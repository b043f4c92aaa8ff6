"""hfpar's sft recipe vs the obvious alternatives and TRL's SFTTrainer on the same work, and what packing buys.

    python -m benchmarks.baselines.sft                         # everything, one process, fp32: ~15 min on 2 CPU cores
    python -m benchmarks.baselines.sft --sections trl --rounds 5   # only the TRL comparison (merged into the results)
    python -m benchmarks.baselines.sft --steps 4 --rounds 1 --out /tmp/bl   # a smoke run, results elsewhere

Same model (the embedded tiny Llama, same init), same tokenized data (the recipe's own hfpar.data path on the
embedded SFT set: completion-only labels), same batch, constant learning rate, same number of steps.
tokens/s = real (non-padding) input tokens / time in the training steps, counted here from the rows each step
used (not from each tool's own counter).
  frameworks: `python recipes/sft.py`, transformers.Trainer with the same collator, a hand-written Accelerate loop
              (final loss = mean of the last 10 steps; all three: mean over the batch's target tokens)
  packing:    padding tokens per batch padded, padding-free (the default) and --packing, hfpar's tokens/s in each
  trl:        TRL's SFTTrainer (`pip install trl`, for this benchmark only; hfpar never depends on it) against
              hfpar, each in its default configuration and packed, in fresh processes, `--rounds` rounds whose
              order alternates (ABAB, then BABA) so that machine load falls on both alike. TRL gets the recipe's
              tokenized rows (labels included, so completion-only loss is the same token set) and, unpacked, in
              hfpar's sampler order through a sequential sampler: both see the same batches, and their per-step
              losses are compared. TRL defaults that change the work are set to hfpar's: fp32 (TRL: bf16) and
              no gradient checkpointing (TRL: on); both clip at 1.0 and use their default AdamW (fused).
              Ratios hfpar / TRL are taken within each round (default vs default, packed vs packed); the results
              give their median and min-max over the rounds.
Writes benchmarks/results/baselines/sft_<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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

from benchmarks.common.launch import ROOT, command, env, module_cmd, results_dir

RESULTS = results_dir("baselines")
BS, STEPS, LR, SEQ, SEED = 16, 60, 1e-3, 128, 42
TRL_STEPS = 100
SECTIONS = ("frameworks", "packing", "trl")
TRL_CASES = {  # name -> SFTConfig overrides
    "TRL (default: padded)": {},
    "TRL padding_free": {"padding_free": True, "max_length": None},  # rows are truncated to SEQ already
    "TRL packing (bfd)": {"packing": True},
}
PAIRS = [("hfpar (default)", "TRL (default: padded)"), ("hfpar --packing", "TRL packing (bfd)")]


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


def recipe_rows(flags: list[str], steps: int) -> tuple:
    """(train dataset, per-step row indices) exactly as `recipes/sft.py <flags>` builds and samples them."""
    from types import SimpleNamespace

    from hfpar import data, recipes
    from hfpar.config import parse_args
    from hfpar.train.sampler import GlobalBatchSampler

    recipe = recipes.get("sft")
    args = parse_args(flags, recipe="sft", defaults=dict(recipe.defaults), args_class=recipe.args_class)
    one_process = SimpleNamespace(seq_multiple=1)  # the data builder's view of the context and run plan
    plan = SimpleNamespace(task="lm", padding_free=False)
    train, *_ = recipe.build_data(args, data.load_tokenizer(args.tokenizer_path), one_process, plan)
    sampler = GlobalBatchSampler(len(train), BS, 1, 0, 1, args.seed)
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
    max_seq_length padded to the longest row (the default), `packing` the packed dataset's rows."""
    from hfpar.data.collate import first_fit_decreasing

    ds, _, _ = dataset(mode == "packing")
    real = total = 0
    for i in range(0, min(len(ds), BS * 50), BS):
        lengths = [len(ds[j]["input_ids"]) for j in range(i, min(i + BS, len(ds)))]
        real += sum(lengths)
        if mode == "padding_free":
            rows = [sum(lengths[k] for k in row) for row in first_fit_decreasing(lengths, SEQ)]
            total += len(rows) * max(rows)
        else:
            total += len(lengths) * max(lengths)
    return 1 - real / total


# ----------------------------------------------------------------------------------------------- TRL
def trl_worker(case: str, steps: int, out: str) -> None:
    """One TRL SFTTrainer run in this (fresh) process; writes its tokens/s and per-step losses to `out`."""
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hfpar import data

    overrides = TRL_CASES[case]
    train, per_step = recipe_rows(["--max_seq_length", str(SEQ), "--seed", str(SEED)], steps)
    if not overrides.get("packing"):  # hfpar's batches, in its order (a sequential sampler below)
        train = train.select([i for ix in per_step for i in ix])
    tokens, ends, losses = [], [], []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    class Counting(SFTTrainer):  # one micro-batch per step: its loss is the step's loss
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")  # padding-free batches have none and no padding
            tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-base-"),
        per_device_train_batch_size=BS,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        seed=SEED,
        disable_tqdm=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        train_sampling_strategy="random" if overrides.get("packing") else "sequential",
        **{"max_length": SEQ, **overrides},
    )
    trainer = Counting(
        model=fresh_model(SEED),
        args=config,
        train_dataset=train,
        processing_class=data.load_tokenizer(None),
        callbacks=[StepEnds()],
    )
    t0 = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([t0, *ends[:-1]], ends)]
    Path(out).write_text(
        json.dumps(
            {"tokens_per_s": _rate(tokens, times), "losses": losses, "final_loss": statistics.mean(losses[-10:])}
        )
    )


def run_trl(case: str, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="trl-base-")) / "result.json"
    cmd = module_cmd("benchmarks.baselines.sft", "--trl_case", case, "--steps", steps, "--trl_out", out)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env(cpu=False, threads=None))
    if proc.returncode:
        raise RuntimeError(f"{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def compare_trl(steps: int, rounds: int) -> dict:
    cases = [(name, "hfpar", flags) for name, flags in hfpar_cases().items()] + [(n, "trl", None) for n in TRL_CASES]
    order = [c for pair in PAIRS for c in cases if c[0] in pair]  # each pair back to back
    order += [c for c in cases if c not in order]
    per_round = []
    for r in range(rounds):
        res = {}
        for name, tool, flags in order if r % 2 == 0 else order[::-1]:
            print(f"[baselines] round {r + 1}/{rounds}: {name}", flush=True)
            res[name] = run_hfpar(flags, steps, max_grad_norm="1.0") if tool == "hfpar" else run_trl(name, steps)
        per_round.append(res)
    summary = {
        name: {
            "tokens_per_s": _spread([rr[name]["tokens_per_s"] for rr in per_round]),
            "final_loss": statistics.median(rr[name]["final_loss"] for rr in per_round),
        }
        for name, _, _ in cases
    }
    ratios = {
        f"{a} / {b}": _spread([rr[a]["tokens_per_s"] / rr[b]["tokens_per_s"] for rr in per_round]) for a, b in PAIRS
    }
    same = per_round[0]
    loss_diff = {
        name: max(abs(x - y) / abs(y) for x, y in zip(same[name]["losses"], same[PAIRS[0][1]]["losses"]))
        for name in (PAIRS[0][0], "TRL padding_free", "hfpar --padding_free false")
        if name in same
    }
    return {
        "steps": steps,
        "rounds": rounds,
        "summary": summary,
        "ratios": ratios,
        "max_rel_step_loss_diff_vs_trl_padded": loss_diff,
        "per_round": [
            {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in rr.items()} for rr in per_round
        ],
    }


# ----------------------------------------------------------------------------------------------- report
def markdown(res: dict, dev: str) -> str:
    meta = res["meta"]
    lines = [
        f"# hfpar vs transformers.Trainer, a plain Accelerate loop and TRL's SFTTrainer ({dev}, one process, fp32)",
        "",
        f"Command: `{meta['command']}`; {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}"
        + (f", TRL {meta['trl']}" if meta.get("trl") else "")
        + f". Embedded tiny Llama and SFT data, batch {BS}, "
        f"constant lr {LR}, max_seq_length {SEQ}. tokens/s: real (non-padding) input tokens per second of "
        "training steps, counted from the rows each step used.",
        "",
    ]
    if "frameworks" in res:
        lines += [
            f"{meta['steps']} steps, no clipping:",
            "",
            "| run | tokens/s | loss (mean of last 10 steps) |",
            "|---|---|---|",
        ]
        lines += [f"| {k} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |" for k, v in res["frameworks"].items()]
        lines.append("")
    if "packing" in res:
        lines += [
            "Packing (hfpar sft recipe, same batch and max_seq_length):",
            "",
            "| mode | padding tokens per batch | tokens/s (real tokens) | loss (last 10) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['padding_fraction']:.1%} | {v['tokens_per_s']:.0f} | {v['final_loss']:.4f} |"
            for k, v in res["packing"].items()
        ]
        lines.append("")
    if "trl" in res:
        t = res["trl"]
        lines += [
            f"## hfpar vs TRL SFTTrainer: {t['steps']} steps, clipping at 1.0, {t['rounds']} alternating rounds",
            "",
            "| run | tokens/s median (min-max) | loss (last 10, median) |",
            "|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['tokens_per_s']['median']:.0f} ({v['tokens_per_s']['min']:.0f}-"
            f"{v['tokens_per_s']['max']:.0f}) | {v['final_loss']:.4f} |"
            for k, v in t["summary"].items()
        ]
        lines += ["", "| ratio of real tokens/s | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['median']:.2f}x | {v['min']:.2f}x | {v['max']:.2f}x |" for k, v in t["ratios"].items()]
        lines += [
            "",
            "Same batches, per-step loss vs TRL (default: padded), max relative difference (round 1): "
            + ", ".join(f"{k} {v:.1e}" for k, v in t["max_rel_step_loss_diff_vs_trl_padded"].items())
            + ". The packed runs see different rows per step (each tool packs its own way), so their losses "
            "are comparable only in level. Step time: hfpar's own step_time_s (collate to optimizer step); "
            "TRL's, the time between consecutive step ends (data loading, step, callbacks; it logs every 10 "
            "steps, its default). Ratios are taken within each round, then summarized.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS}; TRL section {TRL_STEPS})")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the TRL comparison (>= 3 for a spread)")
    p.add_argument("--out", default=str(RESULTS), help="results directory (merged into its existing results file)")
    p.add_argument("--trl_case", choices=list(TRL_CASES), help=argparse.SUPPRESS)  # internal: one TRL run
    p.add_argument("--trl_out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_case:
        return trl_worker(a.trl_case, a.steps or TRL_STEPS, a.trl_out)
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"--sections {','.join(bad)}: valid sections are {', '.join(SECTIONS)}")
    if "trl" in sections and importlib.util.find_spec("trl") is None:
        sys.exit(
            "baselines: TRL is not installed; `pip install trl` into this environment for the benchmark "
            "(hfpar does not depend on it), or run --sections frameworks,packing"
        )
    steps = a.steps or STEPS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(a.out) / f"sft_{dev}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res["meta"] = {
        **res.get("meta", {}),
        "command": command(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "batch": BS,
        "lr": LR,
        "max_seq_length": SEQ,
    }
    if sections != ["trl"]:
        res["meta"]["steps"] = steps
    if "frameworks" in sections:
        res["frameworks"] = {
            "hfpar sft recipe": run_hfpar([], steps),
            "transformers Trainer": run_trainer(steps),
            "hand-written Accelerate loop": run_accelerate_loop(steps),
        }
    if "packing" in sections:
        res["packing"] = {
            "padded (--padding_free false)": {
                "padding_fraction": padding_fraction("padded"),
                **run_hfpar(["--padding_free", "false"], steps),
            },
            "padding-free (default)": {"padding_fraction": padding_fraction("padding_free"), **run_hfpar([], steps)},
            "--packing": {"padding_fraction": padding_fraction("packing"), **run_hfpar(["--packing"], steps)},
        }
    if "trl" in sections:
        import trl

        res["meta"]["trl"] = trl.__version__
        res["trl"] = {"command": res["meta"]["command"], **compare_trl(a.steps or TRL_STEPS, a.rounds)}
    for key in ("frameworks", "packing"):
        for v in res.get(key, {}).values():
            v.pop("losses", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    text = markdown(res, dev)
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
