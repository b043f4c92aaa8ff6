"""Recipes as records: what differs between sft, clm, classify, dpo (and a user's own) is declared in one module
each; hfpar.recipe.main runs any of them without testing a name.

    from hfpar.recipes import Recipe, RecipeData, register, get
    recipe = get("sft")                 # imports hfpar.recipes.sft on first use (it registers itself)
    register(Recipe(name="mine", task="lm", build_data=my_data, objective=my_objective))
    main("mine")                        # hfpar.recipe.main

A Recipe's fields (all but name / task have a default):
    task          "lm" (causal LM) | "classify": the model head and the default objective
    defaults      the recipe's own option defaults (every run; --help shows them)
    demo          the embedded run's options (its tiny model's steps, learning rate, lengths): only where the run
                  names no model (`python recipes/<name>.py` with no arguments), never for a user's model
    args_class    RecipeArgs or a subclass with the recipe's own options (parsed by the one parser)
    build_data    (args, tokenizer, ctx, plan) -> RecipeData
    packed        (args) -> whether the data's rows are packed already (padding-free batches then do nothing)
    problems      (args, ctx, plan) -> its own preflight problems, one line each (after the shared checks)
    resolve       (args, ctx, plan) -> values of its own derived once (plan.recipe_values)
    objective     (args, ctx, plan, model, data) -> Objective (hfpar.objectives), after parallelize (data: the
                  RecipeData build_data returned)
    one_row       its collator joins a micro-batch into ONE row where the attention skips the pairs between samples
                  (hfpar.data.DataCollator one_row: plan.one_row; sft and clm's text rows)
    image_text    the recipe trains vision-language models too (sft: image + text rows): a model whose config is one
                  (hfpar.data.vision.is_image_text) is built by AutoModelForImageTextToText (plan.image_text)
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hfpar.config import RecipeArgs
from hfpar.objectives.base import Objective


class RecipeData(NamedTuple):
    train: Any  # a dataset of samples (indexable, len)
    eval: Any  # the same for evaluation, or None
    collator: Callable  # samples -> a batch of tensors
    info: dict  # run_info.json fields (data statistics)
    num_labels: int | None = None  # classify: the head's size
    processor: Any = None  # saved beside the model instead of the tokenizer (a vision-language model's processor)


def _packing(args) -> bool:
    return args.packing


def _no_problems(args, ctx, plan) -> list[str]:
    return []


def _no_values(args, ctx, plan) -> Mapping[str, Any]:
    return {}


def task_objective(args, ctx, plan, model, data: RecipeData) -> Objective:
    """The task's token-normalized loss (hfpar.objectives.base)."""
    return Objective.for_task(plan.task, model)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    task: str = "lm"
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    demo: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    args_class: type = RecipeArgs
    build_data: Callable[..., RecipeData] | None = None
    packed: Callable[[Any], bool] = _packing
    problems: Callable[..., list[str]] = _no_problems
    resolve: Callable[..., Mapping[str, Any]] = _no_values
    objective: Callable[..., Objective] = task_objective
    one_row: bool = False
    image_text: bool = False


_REGISTRY: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Adds (or replaces) a recipe under its name; returns it."""
    _REGISTRY[recipe.name] = recipe
    return recipe


def builtin() -> list[str]:
    """The recipe modules of this package, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def get(name: str) -> Recipe:
    """The recipe registered as `name`, importing hfpar.recipes.<name> first if needed; KeyError if none."""
    if name not in _REGISTRY and name in builtin():
        importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTRY:
        raise KeyError(f"unknown recipe {name!r} (known: {', '.join(dict.fromkeys([*builtin(), *_REGISTRY]))})")
    return _REGISTRY[name]


def names_of_task(task: str) -> str:
    """'clm, dpo, sft': the recipes of a task, for messages."""
    return ", ".join(n for n in dict.fromkeys([*builtin(), *_REGISTRY]) if get(n).task == task)
