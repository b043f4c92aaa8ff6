"""Image + text SFT cases: a tiny vision-language model on disk (scripts/make_tiny_vlm.py: idefics3 or llava, random
init), the shapes task as a dataset directory (PNG files named by path in train.jsonl / eval.jsonl), and hfpar's sft
recipe and TRL 1.16's SFTTrainer run on them in this process (one process, CPU, fp32).

    model_dir, data_dir = make_vlm_case(tmp, "idefics3")
    trl = run_trl(model_dir, data_dir, out)        # [{loss, grad_norm, ...}, ...] per step
    ours = run_hfpar(model_dir, data_dir, out)     # metrics.jsonl records

Same batches: hfpar's sampler draws step s's rows from one seeded permutation (hfpar.train.sampler); TRL is given
the rows in that order and samples them sequentially. Rows are conversational prompt / completion (TRL then trains
on the completion only, as hfpar does): questions and answers of several lengths, so rows are padded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hfpar.data.shapes import shape_row
from hfpar.train.sampler import GlobalBatchSampler
from scripts.make_tiny_vlm import write_vlm

QUESTIONS = ("What is in the image?", "Describe it.", "Count the squares and name their colour, please.")
COMMON = {"steps": 8, "batch": 4, "lr": 1e-3, "max_grad_norm": 0.5, "seed": 42}


def write_rows(root: Path, split: str, rows: list[dict], seed: int) -> None:
    """rows (hfpar.data.shapes) -> root/<split>.jsonl, images as PNG files under root/images/ named by path."""
    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, row in enumerate(rows):
        name = f"images/{split}_{i}.png"
        row["images"][0].save(root / name)
        answer = row["messages"][1]["content"]
        lines.append(
            {
                "images": [name],
                "prompt": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                "completion": [{"role": "assistant", "content": answer if i % 2 else f"I see {answer} squares."}],
            }
        )
    (root / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def make_vlm_case(root: Path, family: str = "idefics3", n_train: int = 48, n_eval: int = 8) -> tuple[str, str]:
    root = Path(root)
    model = write_vlm(root / f"model_{family}", family, weights=True)
    data = root / "data"
    if not (data / "train.jsonl").exists():
        rng = random.Random(7)
        write_rows(data, "train", [shape_row(rng) for _ in range(n_train)], 1)
        write_rows(data, "eval", [shape_row(rng) for _ in range(n_eval)], 2)
    return model, str(data)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_trl(model_dir: str, data_dir: str, out: str, steps: int = COMMON["steps"], batch: int = COMMON["batch"]):
    """TRL SFTTrainer's per-step records on the rows of train.jsonl (images opened as PIL), in hfpar's order."""
    from datasets import Dataset
    from PIL import Image
    from torch.utils.data import SequentialSampler
    from transformers import AutoProcessor
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(x) for x in Path(data_dir, "train.jsonl").read_text().splitlines()]
    order = GlobalBatchSampler(len(rows), batch, 1, 0, 1, COMMON["seed"])._perm(0).tolist()
    for r in rows:
        r["images"] = [Image.open(Path(data_dir, p)).convert("RGB") for p in r["images"]]
    ds = Dataset.from_list([rows[i] for i in order])

    class Sequential(SFTTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    _reset_accelerate()
    args = SFTConfig(
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
        use_cpu=True,
        bf16=False,  # TRL 1.16 defaults to bf16 autocast: the comparison is fp32
        seed=COMMON["seed"],
        max_length=None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=False,
    )
    trainer = Sequential(
        model=model_dir, args=args, train_dataset=ds, processing_class=AutoProcessor.from_pretrained(model_dir)
    )
    trainer.train()
    _reset_accelerate()
    return [r for r in trainer.state.log_history if "loss" in r and "step" in r]


def run_hfpar(model_dir: str, data_dir: str, out: str, steps: int = COMMON["steps"], batch: int = COMMON["batch"]):
    """hfpar's sft recipe on the same model and rows, in this process: its metrics.jsonl records."""
    from hfpar.recipe import main

    argv = [
        *("--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out),
        *("--overwrite_output_dir", "true", "--per_device_train_batch_size", str(batch), "--max_steps", str(steps)),
        *("--learning_rate", str(COMMON["lr"]), "--lr_scheduler_type", "constant", "--warmup_ratio", "0"),
        *("--max_grad_norm", str(COMMON["max_grad_norm"]), "--logging_steps", "1", "--seed", str(COMMON["seed"])),
        *("--eval_steps", "0", "--save_final_model", "false", "--optim", "adamw_torch_fused"),
    ]
    _reset_accelerate()
    main("sft", argv)
    _reset_accelerate()
    return [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
