"""benchmarks/baselines/sft.py's TRL section: hfpar's recipe against TRL's SFTTrainer, each case in its own process.

res = compare_trl(steps=100, rounds=3)           # the PAIRS of cases, interleaved, with their spread
trl_worker("packing", 100, out)                  # one TRL case in this process (sft.py --trl_case runs it)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.baselines.sft_runs import BS, LR, SEED, SEQ, _rate, fresh_model, hfpar_cases, recipe_rows, run_hfpar
from benchmarks.common.launch import ROOT, env, module_cmd

TRL_CASES = {  # name -> SFTConfig overrides
    "TRL (default: padded)": {},
    "TRL padding_free": {"padding_free": True, "max_length": None},  # rows are truncated to SEQ already
    "TRL packing (bfd)": {"packing": True},
}


PAIRS = [("hfpar (default)", "TRL (default: padded)"), ("hfpar --packing", "TRL packing (bfd)")]


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
