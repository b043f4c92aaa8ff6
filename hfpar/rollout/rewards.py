"""Reward functions for online RL, with TRL's names and signature.

    funcs = resolve_reward_funcs(["exact_match", "my_pkg.rewards:brevity", "out/reward_model"])  # before loading
    per_func = score(funcs, prompts, completions, completion_ids, columns, step)   # (N, F) float32, NaN = None

A spec is one of:
  - a built-in name (BUILTINS: exact_match, numeric_match: the completion against the dataset's `answer` column);
  - `module.path:function`, a callable with TRL's signature `f(prompts, completions, completion_ids, **kwargs) ->
    list[float | None]` (kwargs: the dataset's other columns, one value per completion, `trainer_state` (a
    transformers TrainerState), `log_metric` and `log_extra` (hfpar.rollout.reward_log)); the module is imported
    (the user's own code, named by the user on the command line);
  - a directory holding a sequence-classification model (e.g. `recipes/reward.py`'s output): its first logit is the
    reward, scored on prompt + completion (TRL's reward-model path). Loaded later (load_reward_model).
Problems are one line naming the value and what would be valid (RewardError), before the policy loads where they can
be known then (a spec), else at the step that shows them (a count, a non-finite value, an exception inside).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hfpar.config import ConfigError


class RewardError(ConfigError):
    """A reward function that cannot be found or returned something unusable; one line."""


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _text(completion) -> str:
    """A completion as text: a string, or a conversational completion's (last) assistant message."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion, stripped, equals the example's `answer`, else 0.0."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def numeric_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the first number in the completion equals the example's numeric `answer`, else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        m = _NUMBER.search(_text(c))
        out.append(float(m is not None and float(m.group()) == float(a)))
    return out


BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "numeric_match": numeric_match}


@dataclass
class RewardFunc:
    name: str  # TRL's: the function's __name__, or the model directory's name (rewards/<name>/mean)
    spec: str  # as given on the command line
    func: Callable | None = None  # a callable; None for a reward model until load_reward_model
    model_dir: Path | None = None


def _is_reward_model_dir(path: Path) -> bool:
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForSequenceClassification") for a in archs)


def resolve_reward_func(spec: str) -> RewardFunc:
    if spec in BUILTINS:
        return RewardFunc(spec, spec, BUILTINS[spec])
    path = Path(spec)
    if path.is_dir():
        if not _is_reward_model_dir(path):
            raise RewardError(
                f"--reward_funcs {spec}: a directory, but not a sequence-classification model (its "
                "config.json names no *ForSequenceClassification architecture)"
            )
        return RewardFunc(path.name, spec, model_dir=path)
    if ":" not in spec:
        raise RewardError(
            f"--reward_funcs {spec!r}: not a built-in ({', '.join(BUILTINS)}), a `module.path:function` "
            "or a reward model directory"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"--reward_funcs {spec}: module {module_name!r} cannot be imported ({exc})") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise RewardError(f"--reward_funcs {spec}: {module_name} has no callable {attr!r}")
    return RewardFunc(getattr(func, "__name__", attr), spec, func)


def resolve_reward_funcs(specs: list[str], weights: list[float] | None = None) -> list[RewardFunc]:
    if not specs:
        raise RewardError(
            "--reward_funcs: at least one reward function is needed (a built-in: "
            f"{', '.join(BUILTINS)}; a `module.path:function`; a reward model directory)"
        )
    if weights is not None and len(weights) != len(specs):
        raise RewardError(f"--reward_weights {weights}: one weight per --reward_funcs entry ({len(specs)})")
    return [resolve_reward_func(s) for s in specs]


def _checked(rf: RewardFunc, values, n: int, step: int) -> list[float]:
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):  # a 1-D tensor / array (TRL iterates it)
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(
            f"step {step}: reward function {rf.name!r} returned {got} rewards for {n} completions "
            "(one float or None per completion)"
        )
    out = []
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(math.nan)  # unscorable by this function (TRL: None becomes NaN, left out by its nansum)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(
                f"step {step}: reward function {rf.name!r} returned {v!r} for completion {i}: not a number or None"
            ) from None
        if not math.isfinite(f):
            raise RewardError(
                f"step {step}: reward function {rf.name!r} returned {f} for completion {i}: rewards "
                "must be finite (None marks a completion it cannot score)"
            )
        out.append(f)
    return out


def score(
    funcs: list[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    step: int,
    trainer_state=None,
    log=None,
) -> torch.Tensor:
    """(N, F) rewards of the callables (reward models are scored by their own component, which fills their
    column); an exception inside a function becomes one line naming it. trainer_state: a transformers TrainerState;
    log: a hfpar.rollout.reward_log.RewardLog, whose log_metric / log_extra the functions get (TRL's kwargs)."""
    n = len(completions)
    out = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    logging = {"log_extra": log.log_extra, "log_metric": log.log_metric} if log is not None else {}
    for j, rf in enumerate(funcs):
        if rf.func is None:
            continue
        try:
            values = rf.func(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=trainer_state,
                **logging,
                **columns,
            )
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure is said in one line
            raise RewardError(
                f"step {step}: reward function {rf.name!r} raised {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        out[:, j] = torch.tensor(_checked(rf, values, n, step), dtype=torch.float32)
    return out
