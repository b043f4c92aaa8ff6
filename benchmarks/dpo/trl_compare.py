"""hfpar's dpo recipe and TRL 1.16's DPOTrainer on the same tiny model, pairs and batches, in this process (one
process, CPU, fp32): what tests/unit/test_dpo_trl.py and benchmarks/dpo/speed.py compare.

    model_dir, data_file = make_case(tmp)                        # a tiny Llama on disk, pairs as JSON Lines
    trl = run_trl(model_dir, data_file, out, loss_type="ipo")   # [{loss, rewards/..}, ...] per step
    ours = run_hfpar(model_dir, data_file, out, loss_type="ipo")

Same batches: hfpar's sampler draws step s's pairs from one seeded permutation (hfpar.train.sampler); TRL is
given the pairs in that order and samples them sequentially.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hfpar.data.load import embedded_model_path
from hfpar.data.preference import make_preference
from hfpar.train.sampler import GlobalBatchSampler

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
COMMON = {"steps": 8, "batch": 4, "lr": 1e-3, "max_grad_norm": 0.5, "seed": 42}


def make_case(
    root: Path,
    pairs: int = 64,
    config_updates: dict | None = None,
    rows: list[dict] | None = None,
    model_type: str | None = None,
) -> tuple[str, str]:
    """(model dir, pairs file): a random-init tiny Llama (or another family: model_type, its defaults with the sizes
    it has of SMALL and config_updates) saved with the embedded tokenizer, conversational pairs (the embedded set's,
    or `rows`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = Path(root)
    cfg = AutoConfig.from_pretrained(embedded_model_path())
    if model_type is not None:
        ids = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
        cfg = AutoConfig.for_model(model_type, **{k: getattr(cfg, k) for k in ids})
    for k, v in {**SMALL, **(config_updates or {})}.items():
        if model_type is None or hasattr(cfg, k):
            setattr(cfg, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(root / "model")
    rows = rows if rows is not None else make_preference(7, n_train=pairs, n_eval=1)["train"].to_list()
    with open(root / "pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return str(root / "model"), str(root / "pairs.jsonl")


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_trl(
    model_dir: str,
    data_file: str,
    out: str,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    precompute: bool = False,
    loss_weights: str | None = None,
    steps: int = COMMON["steps"],
    batch: int = COMMON["batch"],
    max_length: int = 128,
    timing: dict | None = None,
    gradient_checkpointing: bool = False,
    device: str = "cpu",
    bf16: bool = False,
) -> list[dict]:
    """TRL DPOTrainer's per-step records (loss, rewards/*, logps/*). gradient_checkpointing: TRL 1.16's default is
    on (recomputation, the same numbers). bf16: fp32 weights, bf16 autocast (as hfpar's --mixed_precision bf16)."""
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    ds = load_dataset("json", data_files=data_file)["train"]
    order = GlobalBatchSampler(len(ds), batch, 1, 0, 1, COMMON["seed"])._perm(0).tolist()
    ds = ds.select(order)

    class Sequential(DPOTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Clock(TrainerCallback):  # steps 2..N: from the 2nd step's begin to the last step's end
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1 and timing is not None:
                _sync(device)
                timing["t1"], timing["c1"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == steps and timing is not None:
                _sync(device)
                timing["t2"], timing["c2"] = time.perf_counter(), time.process_time()

    _reset_accelerate()
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=COMMON["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=COMMON["max_grad_norm"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        bf16=bf16,
        seed=COMMON["seed"],
        beta=beta,
        loss_type=loss_type.split(","),
        label_smoothing=label_smoothing,
        max_length=max_length,
        loss_weights=[float(w) for w in loss_weights.split(",")] if loss_weights else None,
        precompute_ref_log_probs=precompute,
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=gradient_checkpointing,
    )
    trainer = Sequential(
        model=model_dir,
        args=args,
        train_dataset=ds,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Clock()],
    )
    t0 = time.perf_counter()
    trainer.train()
    _sync(device)
    if timing is not None:
        timing["train_s"] = time.perf_counter() - t0
        timing["steady_s"] = timing["t2"] - timing.get("t1", t0)
        timing["steady_cpu_s"] = timing["c2"] - timing.get("c1", 0.0)
    _reset_accelerate()
    return [r for r in trainer.state.log_history if "loss" in r and "step" in r]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_hfpar(
    model_dir: str,
    data_file: str,
    out: str,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    precompute: bool = False,
    loss_weights: str | None = None,
    steps: int = COMMON["steps"],
    batch: int = COMMON["batch"],
    max_length: int = 128,
    extra: list[str] | None = None,
) -> list[dict]:
    """hfpar's dpo recipe, in this process: its metrics.jsonl records."""
    from hfpar.recipe import main

    argv = [
        "--model_name_or_path",
        model_dir,
        "--dataset_name",
        data_file,
        "--output_dir",
        out,
        "--overwrite_output_dir",
        "true",
        "--per_device_train_batch_size",
        str(batch),
        "--max_steps",
        str(steps),
        "--learning_rate",
        str(COMMON["lr"]),
        "--lr_scheduler_type",
        "constant",
        "--max_grad_norm",
        str(COMMON["max_grad_norm"]),
        "--logging_steps",
        "1",
        "--seed",
        str(COMMON["seed"]),
        "--beta",
        str(beta),
        "--loss_type",
        loss_type,
        "--label_smoothing",
        str(label_smoothing),
        "--max_length",
        str(max_length),
        "--precompute_ref_log_probs",
        str(precompute).lower(),
        "--save_final_model",
        "false",
        "--optim",
        "adamw_torch_fused",
        *(["--loss_weights", loss_weights] if loss_weights else []),
        *(extra or []),
    ]
    _reset_accelerate()
    main("dpo", argv)
    _reset_accelerate()
    return [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
