"""A recipe is a record: one defined here, outside hfpar (its own options, data builder and objective), runs
through hfpar.recipe.main with no change to hfpar's shared modules.

    python -m pytest -q tests/unit/test_recipe_record.py
    python tests/unit/test_recipe_record.py --output_dir /tmp/toy      # the run the test launches
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hfpar.config import RecipeArgs
from hfpar.objectives.base import Objective
from hfpar.recipes import Recipe, RecipeData, register

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ToyArgs(RecipeArgs):
    toy_weight: float = 2.0  # the toy recipe's own option: a factor on its loss
    toy_rows: int = 64  # training rows generated


def build_data(args, tokenizer, ctx, plan) -> RecipeData:
    """Rows counting up from a random start modulo 50: an easy next-token task."""
    rng = random.Random(args.seed)

    def rows(n):
        out = []
        for _ in range(n):
            start = rng.randrange(50)
            ids = [(start + i) % 50 + 10 for i in range(16)]
            out.append({"input_ids": ids, "labels": ids})
        return out

    def collate(samples):
        return {k: torch.tensor([s[k] for s in samples]) for k in ("input_ids", "labels")}

    train = rows(args.toy_rows)
    return RecipeData(train, rows(8), collate, {"train_data": {"rows": len(train)}})


class CountingObjective(Objective):
    """The LM loss times --toy_weight, and a metric of its own: the forwards of the step."""

    def __init__(self, model, weight: float):
        super().__init__(Objective.for_task("lm", model).loss)
        self.weight, self.forwards = weight, 0

    def __call__(self, out, labels):
        loss, n = super().__call__(out, labels)
        self.forwards += 1
        return loss * self.weight, n

    def step_sums(self, device):
        sums, self.forwards = torch.tensor([float(self.forwards)], dtype=torch.float64, device=device), 0
        return sums

    def metrics(self, sums):
        return {"toy_forwards": sums[0]}

    def end_eval(self, device):
        return {"eval_toy": 1.0}


TOY = register(
    Recipe(
        name="toy",
        task="lm",
        args_class=ToyArgs,
        build_data=build_data,
        objective=lambda args, ctx, plan, model, data: CountingObjective(model, args.toy_weight),
        defaults=dict(
            max_steps=3,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            max_eval_samples=8,
        ),
    )
)


def test_a_recipe_of_its_own_runs_through_main(tmp_path):
    out = tmp_path / "toy"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--output_dir", str(out), "--toy_weight", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["toy_forwards"] == 2 for r in steps)  # its metric: one forward per micro-batch (accumulation 2)
    assert any(r.get("eval_toy") == 1.0 for r in records) and (out / "model.safetensors").exists()
    assert json.loads((out / "run_info.json").read_text())["recipe"] == "toy"
    # its own option, parsed by the one parser (with did-you-mean)
    bad = subprocess.run(
        [sys.executable, __file__, "--output_dir", str(tmp_path / "bad"), "--toy_weigth", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "did you mean --toy_weight?" in bad.stderr


if __name__ == "__main__":
    from hfpar.recipe import main

    main(TOY, sys.argv[1:])
