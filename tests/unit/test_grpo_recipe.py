"""The grpo recipe's bad input ends in one line each before the model loads (exit 2), and --advantage_estimator rloo
trains on RLOO's advantages of the same rewards (one small in-process run)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.grpo.trl_compare import REWARD, make_case
from hfpar.recipe import main
from hfpar.rollout.advantages import rloo_advantages
from tests.helpers.in_process import run_in_process


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("grpo_case"), prompts=16)


def _refused(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main("grpo", argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err and all(line.startswith("hfpar: error: ") for line in err), err
    return err


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--num_generations", "1"], "--num_generations 1: must be >= 2"),
        (["--num_generations", "3", "--per_device_train_batch_size", "8"], "does not divide the generation batch"),
        (["--reward_funcs", "no_such_module:f"], "module 'no_such_module' cannot be imported"),
        (["--reward_funcs", "exact_match", "--reward_weights", "1,2"], "one weight per --reward_funcs entry"),
        (["--loss_type", "ppo"], "--loss_type 'ppo': valid values are grpo, dr_grpo, dapo, bnpo, cispo"),
        (["--importance_sampling_level", "doc"], "valid values are token, sequence"),
        (["--steps_per_generation", "3", "--gradient_accumulation_steps", "2"], "must be a multiple of"),
        (["--generation_batch_size", "64", "--steps_per_generation", "2"], "set one of them"),
        (["--num_generations_eval", "0"], "--num_generations_eval 0: must be >= 1"),
        (["--max_prompt_length", "4"], "longer than --max_prompt_length"),
        (["--generation_kwargs", '{"num_beams": 4}'], "num_beams not supported (supported: min_new_tokens)"),
        (["--generation_kwargs", "[1]"], "--generation_kwargs '[1]': expected a mapping"),
        (["--generation_kwargs", '{"min_new_tokens": 300}'], "min_new_tokens 300: above --max_completion_length"),
    ],
)
def test_bad_input_is_one_line_before_the_model_loads(case, tmp_path, capsys, flags, says):
    model, data = case
    err = _refused(
        ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", str(tmp_path), *flags], capsys
    )
    assert any(says in line for line in err), err


def test_a_dataset_without_prompts_is_one_line(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    err = _refused(["--dataset_name", str(tmp_path / "d.jsonl"), "--output_dir", str(tmp_path / "o")], capsys)
    assert any("prompt" in line and "question" in line for line in err), err


def test_rloo_trains_on_leave_one_out_advantages(case, tmp_path):
    model, data = case
    out = tmp_path / "rloo"
    argv = ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", str(out), "--reward_funcs", REWARD]
    argv += ["--advantage_estimator", "rloo", "--max_steps", "2", "--per_device_train_batch_size", "8"]
    argv += [
        "--num_generations",
        "4",
        "--max_completion_length",
        "4",
        "--log_completions",
        "--save_final_model",
        "false",
    ]
    run_in_process("grpo", argv)
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["row"])
        want = rloo_advantages(torch.tensor([r["reward"] for r in mine], dtype=torch.float64), 4)
        assert torch.allclose(torch.tensor([r["advantage"] for r in mine], dtype=torch.float64), want, atol=1e-6)
        assert any(abs(a) > 1e-3 for a in want.tolist())
