"""Composition backends: how the model is wrapped, its grads reduced and clipped, its optimizer stepped and
its per-rank state saved, for each (data-parallel strategy, model parallelism) pair.

    backend_cls = select_backend("fsdp2", ("tp",))      # or raise ConfigError with the table's reason
    backend = backend_cls(accelerator, ctx, "fsdp2", args)

SUPPORT is the support matrix: a class where the pair works (tested by the parity suites), a one-line
reason where it is refused, generated from a rule (the family of the parallelism key, then the strategy's class in
it) plus a table of exceptions. A new composition is one backend module plus its place in the rule.

All strategy knowledge lives in this package: the strategy table (strategies.py: checkpoint layout, loading mode,
what is sharded, wrap-class fix; resolved once per run into ctx.strategy), the data-parallel wrap components the
model-parallel and pipeline backends hold (wraps.py), what DeepSpeed backends share (zero.py), and the accelerate
YAML keys of the DeepSpeed / FSDP sections (launch_config.py: misspelt ones refused).
"""

from __future__ import annotations

from hfpar.config import ConfigError

from .accelerate_dp import AccelerateBackend
from .base import Backend
from .model_parallel import ModelParallelBackend, ModelParallelDDP, ModelParallelFSDP2
from .mp_deepspeed import ModelParallelDeepSpeed
from .mp_zero3 import ModelParallelZeRO3
from .pipeline import PipelineBackend, PipelineDDP, PipelineFSDP2
from .pipeline_zero import PipelineZeRO1
from .strategies import STRATEGY, Strategy, checkpoint_layout, resolve_strategy, strategy_of

STRATEGIES = tuple(name for name, s in STRATEGY.items() if s.runs)  # single ddp fsdp2 zero1 zero2 zero3 fsdp1
PARALLELISMS = (
    "none",
    "tp",
    "ep",
    "cp",
    "tp+cp",
    "tp+ep",
    "ep+cp",
    "tp+ep+cp",
    "pp",
    "tp+pp",
    "ep+pp",
    "cp+pp",
    "tp+ep+pp",
    "tp+cp+pp",
    "ep+cp+pp",
    "tp+ep+cp+pp",
)

_FSDP1 = (
    "FSDP1 is not supported with hfpar's model parallelism: FSDP1 flattens each wrapped unit's parameters into "
    "one FlatParameter, while hfpar's shards are per parameter (TP / EP shards with their own groups, as FSDP2's "
    "DTensors are); use fsdp2.yaml"
)
_PP_ZERO = (
    "pipeline parallelism with DeepSpeed ZeRO-2/3 is not supported (DeepSpeed refuses them with its own "
    "pipeline: they reduce grads inside every backward); use zero1.yaml, ddp.yaml or fsdp2.yaml"
)

# The rule: which family runs a pair follows from whether every rank holds the whole model (no parallelism, or
# context parallelism alone: Accelerate wraps over the world), whether the key has a pipeline, and the strategy.
#   model-parallel (tp, ep, cp with tp or ep): attention / dense MLPs tensor-parallel, MoE blocks whole on the TP
#     ranks with their experts split over EP (drawn from the dp x cp ranks, each cp rank routing its own tokens)
#   pipeline (any key with pp): each rank one stage, its grads reduced over its dp group by hfpar or FSDP2
#     (fully_shard over dp only), each stage tensor / expert / context-parallel as in the pairs above; ZeRO-1 keeps
#     each stage's optimizer state over its dp group, DeepSpeed's norm over the stages x TP ranks, experts beside it
#     (pipeline_zero.py)
_WHOLE_MODEL = dict.fromkeys(STRATEGIES, AccelerateBackend)
_MODEL_PARALLEL = {
    "single": ModelParallelDDP,
    "ddp": ModelParallelDDP,
    "fsdp2": ModelParallelFSDP2,
    "zero1": ModelParallelDeepSpeed,
    "zero2": ModelParallelDeepSpeed,
    "zero3": ModelParallelZeRO3,
    "fsdp1": _FSDP1,
}
_PIPELINE = {
    "single": PipelineDDP,
    "ddp": PipelineDDP,
    "fsdp2": PipelineFSDP2,
    "zero1": PipelineZeRO1,
    "zero2": _PP_ZERO,
    "zero3": _PP_ZERO,
    "fsdp1": _FSDP1,
}
_EXCEPTIONS = {("fsdp1", "cp"): _FSDP1}  # the one pair whose whole-model row is refused


def _family(key: str) -> dict:
    if key in ("none", "cp"):
        return _WHOLE_MODEL
    return _PIPELINE if "pp" in key.split("+") else _MODEL_PARALLEL


SUPPORT: dict[tuple[str, str], type[Backend] | str] = {
    (s, key): _EXCEPTIONS.get((s, key), _family(key)[s]) for key in PARALLELISMS for s in STRATEGIES
}

_FLAG = {"tp": "--tp_size", "ep": "--ep_size", "cp": "--cp_size", "pp": "--pp_size"}
_WHAT = {
    "tp": "tensor parallelism",
    "ep": "expert parallelism",
    "cp": "context parallelism",
    "pp": "pipeline parallelism",
}


def parallelism_key(parallelisms: tuple[str, ...]) -> str:
    return "+".join(parallelisms) or "none"


def select_backend(strategy: str, parallelisms: tuple[str, ...], sizes: dict | None = None) -> type[Backend]:
    """The backend class for the pair, or ConfigError with the table's one-line reason."""
    key = parallelism_key(parallelisms)
    entry = SUPPORT.get((strategy, key))
    if isinstance(entry, type):
        return entry
    flags = " and ".join(f"{_FLAG[p]} {(sizes or {}).get(p, '')}".strip() for p in parallelisms)
    ok = [s for s in STRATEGIES if isinstance(SUPPORT.get((s, key)), type)]
    reason = entry or f"no backend for {strategy} with {key}"
    if len(parallelisms) == 1 and ok:
        ok_text = ", ".join(ok[:-1]) + f" and {ok[-1]}" if len(ok) > 1 else "".join(ok)
        raise ConfigError(f"{flags} with {strategy}: {_WHAT[key]} composes with {ok_text} configs ({reason})")
    raise ConfigError(f"{flags} with {strategy}: {reason}")


def support_table_markdown() -> str:
    """The support matrix as the README shows it (a test keeps the two equal)."""
    cols = [s for s in STRATEGIES if s != "fsdp1"]
    lines = ["| parallelism | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for key in PARALLELISMS:
        cells = []
        for s in cols:
            entry = SUPPORT[(s, key)]
            cells.append(f"yes ({entry.short})" if isinstance(entry, type) else "no")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "SUPPORT",
    "STRATEGIES",
    "PARALLELISMS",
    "select_backend",
    "support_table_markdown",
    "Backend",
    "ModelParallelBackend",
    "AccelerateBackend",
    "ModelParallelDDP",
    "ModelParallelFSDP2",
    "ModelParallelDeepSpeed",
    "ModelParallelZeRO3",
    "PipelineBackend",
    "PipelineDDP",
    "PipelineFSDP2",
    "PipelineZeRO1",
    "STRATEGY",
    "Strategy",
    "checkpoint_layout",
    "resolve_strategy",
    "strategy_of",
]
