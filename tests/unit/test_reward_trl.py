"""TRL equality, end to end: hfpar's reward recipe and TRL 1.16's RewardTrainer on the same tiny Llama reward model
(LlamaForSequenceClassification, one logit), pairs and batches, in this process (one process, CPU, fp32, 6 optimizer
steps of 4 pairs, clipping active): per-step loss and grad norm equal within 1e-4 relative, TRL's metrics
(accuracy, margin, min_reward, mean_reward, max_reward) within 1e-4 of the step's largest |reward|, in three cases:
  conversational   explicit prompt, message lists (the embedded pairs), TRL's default loss
  centered         the same with --center_rewards_coefficient 0.05 (the (r_chosen + r_rejected)^2 term)
  text_margin      standard text (eos appended) with a `margin` column, centered too

    python -m pytest -q -p no:cacheprovider tests/unit/test_reward_trl.py

Same batches: hfpar's sampler draws step s's pairs from one seeded permutation (hfpar.train.sampler); TRL is given
the pairs in that order and samples them sequentially (as tests/unit/test_dpo_trl.py does for DPO)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState

from hfpar.data.load import embedded_model_path
from hfpar.data.preference import make_preference
from hfpar.data.reward_pairs import make_reward_text
from hfpar.train.sampler import GlobalBatchSampler

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # two trainers x 3 cases, a few seconds each on an idle machine

TOL = 1e-4
STEPS, BATCH, LR, CLIP, SEED = 6, 4, 1e-3, 0.5, 42
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_labels": 1,
}
CASES = {"conversational": ("conv", None), "centered": ("conv", 0.05), "text_margin": ("text", 0.05)}
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A random-init tiny Llama reward model saved with the embedded tokenizer; the pairs files."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("reward_trl")
    cfg = AutoConfig.from_pretrained(embedded_model_path())
    for k, v in SMALL.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.1)  # rewards of order 0.1-1 from the first step
    model.save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(root / "model")
    files = {
        "conv": make_preference(7, n_train=32, n_eval=1)["train"].to_list(),
        "text": make_reward_text(7, n=32).to_list(),
    }
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), **{k: str(root / f"{k}.jsonl") for k in files}}


def run_trl(model_dir: str, data_file: str, out: str, center: float | None) -> list[dict]:
    """TRL RewardTrainer's per-step log records (loss, grad_norm, accuracy, margin, ...)."""
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    ds = load_dataset("json", data_files=data_file)["train"]
    ds = ds.select(GlobalBatchSampler(len(ds), BATCH, 1, 0, 1, SEED)._perm(0).tolist())

    class Sequential(RewardTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    _reset_accelerate()
    args = RewardConfig(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=SEED,
        center_rewards_coefficient=center,
        max_length=128,
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=False,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = Sequential(model=model_dir, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    _reset_accelerate()
    return [r for r in trainer.state.log_history if "loss" in r and "step" in r]


def run_hfpar(model_dir: str, data_file: str, out: str, center: float | None) -> list[dict]:
    """hfpar's reward recipe, in this process: its metrics.jsonl step records."""
    from hfpar.recipe import main

    argv = [
        *("--model_name_or_path", model_dir, "--dataset_name", data_file, "--output_dir", out),
        *("--overwrite_output_dir", "true", "--per_device_train_batch_size", str(BATCH)),
        *("--max_steps", str(STEPS), "--learning_rate", str(LR), "--lr_scheduler_type", "constant"),
        *("--warmup_ratio", "0", "--max_grad_norm", str(CLIP), "--logging_steps", "1", "--seed", str(SEED)),
        *("--max_length", "128", "--save_final_model", "false", "--optim", "adamw_torch_fused", "--eval_steps", "0"),
        *("--weight_decay", "0"),  # the recipe's default is 0.1 (its embedded run); TRL's here 0
        *(["--center_rewards_coefficient", str(center)] if center is not None else []),
    ]
    _reset_accelerate()
    main("reward", argv)
    _reset_accelerate()
    return [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _rel(a: float, b: float, floor: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), floor, 1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_per_step_equal_to_trl(case, tmp_path, name):
    data, center = CASES[name]
    trl = run_trl(case["model"], case[data], str(tmp_path / "trl"), center)
    ours = run_hfpar(case["model"], case[data], str(tmp_path / "hfpar"), center)
    assert len(trl) == len(ours) == STEPS
    worst = {}
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        assert h["num_target_tokens"] == BATCH  # the pairs of the step: the unit of the loss
        scale = max(abs(t["min_reward"]), abs(t["max_reward"]))  # the reward metrics: relative to the rewards' size
        for key in ("loss", "grad_norm", *METRICS):
            d = _rel(h[key], t[key], 0.0 if key in ("loss", "grad_norm") else scale)
            worst[key] = max(worst.get(key, 0.0), d)
            assert d <= TOL, f"{name} step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
    assert any(t["grad_norm"] > CLIP for t in trl), "clipping never active"
    assert len({round(t["loss"], 6) for t in trl}) > 1  # the steps differ: training moves the model
    print(f"TRL {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
