"""Each recipe with NO arguments trains the embedded default offline, in < 2 minutes, and learns.

The time asserted is the run's CPU time (user + system of the recipe's process, one thread as users' launches run
it): on an idle core that is its wall time, and unlike wall time it does not grow when the suite's other worker
shares the machine, so these tests run beside the others instead of alone after them (the suite's budget)."""

import json
import resource
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, env
from tests.helpers.results import record

pytestmark = pytest.mark.slow


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(recipe, cwd, argv=()):
    t0 = _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *argv],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = _children_cpu_s() - t0  # CPU seconds of the run (module docstring)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "final eval loss" in proc.stdout and "median tokens/s" in proc.stdout  # the summary table
    out = cwd / "outputs" / recipe
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return elapsed, [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r], out


@pytest.mark.parametrize("recipe", ["sft", "clm"])
def test_lm_recipe_default_learns(recipe, tmp_path):
    elapsed, train, evals, out = _run(recipe, tmp_path)
    record(
        "recipes/default_cpu",
        recipe,
        {"first_train_loss": train[0]["loss"], "eval_loss_by_step": {str(e["step"]): e["eval_loss"] for e in evals}},
        command="python -m pytest -q tests/launch/test_recipes_default.py -k 'lm_recipe or dpo'",
    )
    assert elapsed < 120, f"{recipe} took {elapsed:.0f} CPU-s"
    assert len(evals) >= 2
    # eval loss falls clearly from the first evaluation to the last, and far below the untrained ~ln(V)
    assert evals[-1]["eval_loss"] < 0.75 * evals[0]["eval_loss"], evals
    assert evals[-1]["eval_loss"] < 0.6 * train[0]["loss"], (train[0], evals[-1])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # the run report: a plot and a summary table at the end, measured bytes and memory in run_info
    assert (out / "report.png").stat().st_size > 10_000
    info = json.loads((out / "run_info.json").read_text())
    assert info["grad_bytes_per_rank"] == info["param_bytes_per_rank"]  # fp32 on one process: one grad per param
    assert info["peak_mem_bytes_per_rank"][0] > 0 and info["wall_time_s"] > 0


def test_classify_default_beats_majority_baseline(tmp_path):
    from collections import Counter

    from hfpar import data

    elapsed, train, evals, out = _run("classify", tmp_path)
    assert elapsed < 120, f"classify took {elapsed:.0f} CPU-s"
    labels = data.load_splits(None, "classify")["eval"]["label"]
    majority = Counter(labels).most_common(1)[0][1] / len(labels)
    assert evals[-1]["eval_accuracy"] > majority + 0.2, (evals[-1], majority)
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"]


def test_dpo_default_learns(tmp_path):
    """The embedded DPO default (generated pairs, a random-init tiny Llama): the implicit reward of the chosen answer
    overtakes the rejected one's, steps 101-120 against steps 1-20 (rewards/accuracies and rewards/margins)."""
    elapsed, train, _, out = _run("dpo", tmp_path)
    assert len(train) == 120

    def means(key):  # steps 1-20, steps 101-120
        return tuple(sum(r[key] for r in rows) / len(rows) for rows in (train[:20], train[-20:]))

    acc, margin = means("rewards/accuracies"), means("rewards/margins")
    record(
        "recipes/default_cpu",
        "dpo",
        {
            "rewards/accuracies steps 1-20, 101-120": acc,
            "rewards/margins steps 1-20, 101-120": margin,
            "cpu_s": elapsed,
        },
        command="python -m pytest -q tests/launch/test_recipes_default.py -k 'lm_recipe or dpo'",
    )
    assert elapsed < 120, f"dpo took {elapsed:.0f} CPU-s"
    assert acc[1] >= acc[0] + 0.1, acc
    assert margin[1] > max(3 * margin[0], 0.02), margin
    assert (out / "model.safetensors").is_file()  # a normal HF model


def test_grpo_default_learns(tmp_path):
    """The embedded GRPO default (the warm-started tiny Llama, 8 prompts x 8 completions a step, exact-match reward on
    the repeat task): the mean reward of steps 51-60 clearly above that of steps 1-10; report.png drawn."""
    t0 = _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "grpo.py")],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = _children_cpu_s() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "outputs" / "grpo"
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(train) == 60
    first, last = (sum(r["reward"] for r in rows) / len(rows) for rows in (train[:10], train[-10:]))
    record(
        "recipes/default_cpu",
        "grpo",
        {"reward steps 1-10, 51-60": (first, last), "cpu_s": elapsed},
        command="python -m pytest -q tests/launch/test_recipes_default.py -k grpo",
    )
    assert elapsed < 120, f"grpo took {elapsed:.0f} CPU-s"
    assert last >= first + 0.1, (first, last)
    assert (out / "report.png").stat().st_size > 10_000 and (out / "model.safetensors").is_file()


@pytest.mark.extended
def test_sft_vlm_default_learns_the_shapes(tmp_path):
    """The embedded VLM default (`--model_name_or_path hfpar-tiny-vlm`: a random-init tiny Idefics3 on generated
    shapes): the loss falls from ~ln(128) to a fraction, and the exported model (AutoModelForImageTextToText +
    AutoProcessor) answers most eval images exactly ("2 red"), which the question alone cannot tell."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hfpar.data.shapes import make_shapes

    elapsed, train, evals, out = _run("sft", tmp_path, ["--model_name_or_path", "hfpar-tiny-vlm"])
    model, proc = AutoModelForImageTextToText.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    right = 0
    for row in make_shapes(42)["eval"]:
        question = {"type": "text", "text": row["messages"][0]["content"]}
        msgs = [{"role": "user", "content": [{"type": "image"}, question]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[row["images"]], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=10, do_sample=False)
        answer = proc.tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        right += answer.strip() == row["messages"][1]["content"]
    record(
        "recipes/default_cpu",
        "sft_vlm",
        {"first_train_loss": train[0]["loss"], "last_eval_loss": evals[-1]["eval_loss"], "exact_of_64": right},
        command="python -m pytest -q tests/launch/test_recipes_default.py -k vlm -m extended",
    )
    assert elapsed < 120, f"sft on hfpar-tiny-vlm took {elapsed:.0f} CPU-s"
    assert evals[-1]["eval_loss"] < 0.1 * train[0]["loss"], (train[0], evals[-1])
    assert right >= 48, f"{right} of 64 eval images answered exactly"  # 4 colours x 3 counts: chance is 1 in 12
