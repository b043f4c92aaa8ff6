"""Reward functions: built-ins, `module.path:function` with TRL's signature, a reward model directory, and every bad
input said in one line naming the value.

    python -m pytest -q tests/unit/test_rollout_rewards.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hfpar.rollout.rewards import RewardError, resolve_reward_funcs, score


def answer_len(prompts, completions, completion_ids, trainer_state=None, **kwargs):
    return [float(len(c)) for c in completions]


def returns_two(prompts, completions, **kwargs):
    return [1.0, 2.0]


def returns_inf(prompts, completions, **kwargs):
    return [math.inf] * len(completions)


def returns_tensor_with_nan(prompts, completions, **kwargs):
    return torch.tensor([math.nan] + [2.0] * (len(completions) - 1))


def returns_none_for_first(prompts, completions, **kwargs):
    return [None] + [1.0] * (len(completions) - 1)


def raises(prompts, completions, **kwargs):
    raise KeyError("solution")


ME = __name__


def test_builtins_and_user_callables_score_with_trl_signature():
    funcs = resolve_reward_funcs(["exact_match", "numeric_match", f"{ME}:answer_len", f"{ME}:returns_none_for_first"])
    assert [f.name for f in funcs] == ["exact_match", "numeric_match", "answer_len", "returns_none_for_first"]
    got = score(funcs, ["1+1=", "2+3="], [" 2", "is 5!"], [[1], [2]], {"answer": ["2", "5"]}, step=1)
    assert got[:, 0].tolist() == [1.0, 0.0] and got[:, 1].tolist() == [1.0, 1.0] and got[:, 2].tolist() == [2.0, 5.0]
    assert math.isnan(got[0, 3]) and got[1, 3] == 1.0
    # TRL iterates what a function returns (a tensor too) and turns None into NaN: a NaN is "cannot score" too
    got = score(resolve_reward_funcs([f"{ME}:returns_tensor_with_nan"]), ["a", "b"], ["x", "y"], [[1], [2]], {}, step=1)
    assert math.isnan(got[0, 0]) and got[1, 0] == 2.0
    convo = score(
        funcs[:1],
        [[{"role": "user", "content": "q"}]],
        [[{"role": "assistant", "content": "2"}]],
        [[1]],
        {"answer": ["2"]},
        step=1,
    )
    assert convo.tolist() == [[1.0]]


def test_a_reward_model_directory_is_recognised(tmp_path):
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    (f,) = resolve_reward_funcs([str(tmp_path / "rm")])
    assert f.model_dir == tmp_path / "rm" and f.func is None and f.name == "rm"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_builtin", r"--reward_funcs 'no_such_builtin': not a built-in \(exact_match, numeric_match\)"),
        (
            "no_such_module_xyz:f",
            r"--reward_funcs no_such_module_xyz:f: module 'no_such_module_xyz' cannot be imported",
        ),
        (f"{ME}:missing", rf"--reward_funcs {ME}:missing: {ME} has no callable 'missing'"),
    ],
)
def test_a_reward_function_not_found_is_one_line(spec, message):
    with pytest.raises(RewardError, match=message) as err:
        resolve_reward_funcs([spec])
    assert "\n" not in str(err.value)


def test_a_directory_that_is_not_a_reward_model_and_bad_weights(tmp_path):
    with pytest.raises(RewardError, match="a directory, but not a sequence-classification model"):
        resolve_reward_funcs([str(tmp_path)])
    with pytest.raises(RewardError, match=r"--reward_weights \[1.0\]: one weight per --reward_funcs entry \(2\)"):
        resolve_reward_funcs(["exact_match", "numeric_match"], [1.0])
    with pytest.raises(RewardError, match="at least one reward function"):
        resolve_reward_funcs([])


@pytest.mark.parametrize(
    "func,message",
    [
        ("returns_two", r"step 3: reward function 'returns_two' returned 2 rewards for 3 completions"),
        ("returns_inf", r"step 3: reward function 'returns_inf' returned inf for completion 0: rewards must be finite"),
        ("raises", r"step 3: reward function 'raises' raised KeyError: 'solution'"),
    ],
)
def test_a_reward_function_that_misbehaves_is_one_line(func, message):
    funcs = resolve_reward_funcs([f"{ME}:{func}"])
    with pytest.raises(RewardError, match=message) as err:
        score(funcs, ["a", "b", "c"], ["x", "y", "z"], [[1], [2], [3]], {}, step=3)
    assert "\n" not in str(err.value)
