"""hfpar's grpo recipe and TRL 1.16's GRPOTrainer on the same tiny model, prompts, rewards and completions, in this
process (one process, CPU, fp32): what tests/unit/test_grpo_trl.py and benchmarks/grpo/speed.py compare.

    model_dir, data_file = make_case(tmp)                              # a tiny Llama on disk, prompts as JSON Lines
    ours, completions = run_hfpar(model_dir, data_file, out, loss_type="grpo", beta=0.04)
    trl = run_trl(model_dir, data_file, out2, completions, loss_type="grpo", beta=0.04)

Same completions: TRL is given hfpar's (its `rollout_func`, in generation order), so both train on the same rows.
Same prompts: hfpar's schedule draws each generation's prompts from one seeded permutation (hfpar.rollout.schedule);
TRL gets the prompts in that order and samples them sequentially (shuffle_dataset False). The reward is dense
(`letter_share`), so a random model's
completions already get different rewards.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from benchmarks.dpo.trl_compare import _reset_accelerate
from hfpar.data.load import embedded_model_path
from hfpar.rollout.schedule import RolloutSchedule

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
COMMON = {"steps": 4, "batch": 8, "generations": 4, "lr": 3e-3, "max_grad_norm": 0.5, "seed": 42, "completion": 6}


def letter_share(prompts, completions, letter, **kwargs) -> list[float]:
    """The share of each completion's characters that are its prompt's `letter` column, plus a tenth of its number of
    distinct characters (a dense reward: a random model's completions already differ in it)."""
    out = []
    for c, ch in zip(completions, letter):
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(sum(x == ch for x in text) / max(len(text), 1) + 0.1 * len(set(text)))
    return out


REWARD = f"{__name__}:letter_share"


def make_case(root: Path, prompts: int = 64) -> tuple[str, str]:
    """(model dir, prompts file): a random-init tiny Llama with the embedded tokenizer; prompts "repeat x 3"."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = Path(root)
    cfg = AutoConfig.from_pretrained(embedded_model_path())
    for k, v in SMALL.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as fh:
        for _ in range(prompts):
            ch, n = rng.choice("abcde"), rng.randint(1, 5)
            fh.write(json.dumps({"prompt": f"repeat {ch} {n}", "letter": ch}) + "\n")
    return str(root / "model"), str(root / "prompts.jsonl")


def _argv(model_dir, data_file, out, kw: dict) -> list[str]:
    c = COMMON
    base = {
        "model_name_or_path": model_dir,
        "dataset_name": data_file,
        "output_dir": out,
        "reward_funcs": REWARD,
        "max_steps": c["steps"],
        "per_device_train_batch_size": c["batch"],
        "num_generations": c["generations"],
        "max_completion_length": c["completion"],
        "learning_rate": c["lr"],
        "lr_scheduler_type": "constant",
        "max_grad_norm": c["max_grad_norm"],
        "seed": c["seed"],
        "logging_steps": 1,
        "log_completions": True,
        "save_final_model": False,
        **kw,
    }
    return [x for k, v in base.items() if v is not None for x in (f"--{k}", str(v))]


def run_hfpar(model_dir: str, data_file: str, out: str, **kw) -> tuple[list[dict], list[dict]]:
    """(per-step records, completions in generation order) of hfpar's grpo recipe in this process."""
    from hfpar.recipe import main

    _reset_accelerate()
    main("grpo", _argv(model_dir, data_file, out, kw))
    _reset_accelerate()
    rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    done = [json.loads(x) for x in Path(out, "completions.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], done


def prompt_order(n_prompts: int, kw: dict) -> list[int]:
    """The dataset indices of hfpar's prompts, window after window (one process)."""
    c = COMMON
    accum = int(kw.get("gradient_accumulation_steps", 1))
    sched = RolloutSchedule(
        num_prompts=n_prompts,
        num_generations=c["generations"],
        per_device=c["batch"],
        dp=1,
        accum=accum,
        steps_per_generation=int(kw.get("steps_per_generation") or accum),
        num_iterations=int(kw.get("num_iterations", 1)),
        seed=c["seed"],
    )
    return [i for w in range(sched.windows_per_epoch) for i in sched.prompts(w)]


def run_trl(model_dir: str, data_file: str, out: str, completions: list[dict] | None, **kw) -> list[dict]:
    """TRL GRPOTrainer's per-step records, its rollout_func handing out hfpar's completions in order (None: TRL
    generates its own, with transformers' generate)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    c = COMMON
    ds = load_dataset("json", data_files=data_file)["train"]
    ds = ds.select(prompt_order(len(ds), kw))
    tok = AutoTokenizer.from_pretrained(model_dir)
    queue = list(completions or [])

    per_call = c["batch"] * int(kw.get("steps_per_generation") or kw.get("gradient_accumulation_steps", 1))

    def rollout_func(prompts, trainer):  # TRL passes each row's prompt (or each prompt once: G rows each)
        rows = [queue.pop(0) for _ in range(per_call)]
        return {
            "prompt_ids": [r["prompt_ids"] for r in rows],
            "completion_ids": [r["completion_ids"] for r in rows],
            "logprobs": [[0.0] * len(r["completion_ids"]) for r in rows],
        }

    _reset_accelerate()
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=c["batch"],
        gradient_accumulation_steps=int(kw.get("gradient_accumulation_steps", 1)),
        max_steps=c["steps"],
        learning_rate=c["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=c["max_grad_norm"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 autocast
        seed=c["seed"],
        num_generations=c["generations"],
        max_completion_length=c["completion"],
        shuffle_dataset=False,
        num_iterations=int(kw.get("num_iterations", 1)),
        loss_type=kw.get("loss_type", "dapo"),
        importance_sampling_level=kw.get("importance_sampling_level", "token"),
        beta=float(kw.get("beta", 0.0)),
        epsilon=float(kw.get("epsilon", 0.2)),
        epsilon_high=float(kw["epsilon_high"]) if kw.get("epsilon_high") is not None else None,
        scale_rewards=kw.get("scale_rewards", "group"),
        mask_truncated_completions=bool(kw.get("mask_truncated_completions", False)),
        temperature=float(kw.get("temperature", 1.0)),  # TRL scores the completions at it (given ones here too)
        disable_tqdm=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[letter_share],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        rollout_func=rollout_func if completions is not None else None,
    )
    trainer.train()
    _reset_accelerate()
    return [r for r in trainer.state.log_history if "loss" in r and "step" in r]
