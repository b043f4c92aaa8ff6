"""hfpar.parallel.errors: a refusal's parts are fields (code reacts to them), its text the one line users read.

python -m pytest -q tests/unit/test_parallel_errors.py
"""

import pickle

from transformers import AutoConfig

from hfpar.parallel.errors import ParallelError, Problem
from hfpar.parallel.tensor_parallel import derived_plan_problem, derived_plan_refusal


def test_fields_and_one_line():
    exc = ParallelError(
        "apply_expert_parallel",
        ["a: num_experts 6 is not divisible by ep_size 4", Problem("b keeps its router", "pass None")],
    )
    assert isinstance(exc, ValueError)
    assert str(exc) == (
        "apply_expert_parallel: a: num_experts 6 is not divisible by ep_size 4; b keeps its router; pass None"
    )
    assert exc.detail == str(exc).removeprefix("apply_expert_parallel: ")
    assert exc.reasons == "a: num_experts 6 is not divisible by ep_size 4; b keeps its router"
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.where, back.problems, str(back)) == (ParallelError, exc.where, exc.problems, str(exc))


def test_derived_plan_refusal_separates_the_hint():
    config = AutoConfig.for_model("granite")
    assert derived_plan_refusal(config) is None and derived_plan_problem(config) is None
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.ple": "embedding_colwise"}
    refusal = derived_plan_refusal(config)
    assert refusal.where == "apply_tensor_parallel" and refusal.problems[0].hint == "pass plan={module pattern: style}"
    assert refusal.reasons.startswith("cannot derive a tensor-parallel plan for model_type 'granite'")
    assert (
        derived_plan_problem(config) == str(refusal) == f"apply_tensor_parallel: {refusal.reasons}; "
        "pass plan={module pattern: style}"
    )
