"""Composition backends: how the model is wrapped, its grads reduced and clipped, its optimizer stepped and
its per-rank state saved, for each (data-parallel strategy, model parallelism) pair.

    backend_cls = select_backend("fsdp2", ("tp",))      # or raise ConfigError with the table's reason
    backend = backend_cls(accelerator, ctx, "fsdp2", args)

SUPPORT is the support matrix: a class where the pair works (tested by the parity suites), a one-line
reason where it is refused. A new composition is one backend module plus its rows here.

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

STRATEGIES = tuple(name for name, s in STRATEGY.items() if s.runs)   # single ddp fsdp2 zero1 zero2 zero3 fsdp1
PARALLELISMS = ("none", "tp", "ep", "cp", "tp+cp", "tp+ep", "ep+cp", "tp+ep+cp", "pp", "tp+pp", "ep+pp", "cp+pp",
                "tp+ep+pp", "tp+cp+pp", "ep+cp+pp", "tp+ep+cp+pp")

_FSDP1 = ("FSDP1 is not supported with hfpar's model parallelism: FSDP1 flattens each wrapped unit's parameters into "
          "one FlatParameter, while hfpar's shards are per parameter (TP / EP shards with their own groups, as FSDP2's "
          "DTensors are); use fsdp2.yaml")
_PP_ZERO = ("pipeline parallelism with DeepSpeed ZeRO-2/3 is not supported (DeepSpeed refuses them with its own "
            "pipeline: they reduce grads inside every backward); use zero1.yaml, ddp.yaml or fsdp2.yaml")
_PP_MULTI = ("tp+ep+pp", "tp+cp+pp", "ep+cp+pp", "tp+ep+cp+pp")   # a pipeline with two or three others

SUPPORT: dict[tuple[str, str], type[Backend] | str] = {
    **{(s, "none"): AccelerateBackend for s in STRATEGIES},
    ("single", "tp"): ModelParallelDDP, ("ddp", "tp"): ModelParallelDDP, ("fsdp2", "tp"): ModelParallelFSDP2,
    ("zero1", "tp"): ModelParallelDeepSpeed, ("zero2", "tp"): ModelParallelDeepSpeed,
    ("zero3", "tp"): ModelParallelZeRO3, ("fsdp1", "tp"): _FSDP1,
    ("single", "ep"): ModelParallelDDP, ("ddp", "ep"): ModelParallelDDP, ("fsdp2", "ep"): ModelParallelFSDP2,
    ("zero1", "ep"): ModelParallelDeepSpeed, ("zero2", "ep"): ModelParallelDeepSpeed,
    ("zero3", "ep"): ModelParallelZeRO3, ("fsdp1", "ep"): _FSDP1,
    # TP x EP: attention (and dense MLPs) tensor-parallel, MoE blocks whole on the TP ranks, experts split over EP
    ("single", "tp+ep"): ModelParallelDDP, ("ddp", "tp+ep"): ModelParallelDDP, ("fsdp2", "tp+ep"): ModelParallelFSDP2,
    ("zero1", "tp+ep"): ModelParallelDeepSpeed, ("zero2", "tp+ep"): ModelParallelDeepSpeed,
    ("zero3", "tp+ep"): ModelParallelZeRO3, ("fsdp1", "tp+ep"): _FSDP1,
    # context parallelism alone: every rank of dp x cp holds the whole model, Accelerate wraps over the world
    **{(s, "cp"): AccelerateBackend for s in ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")},
    ("fsdp1", "cp"): _FSDP1,
    ("single", "tp+cp"): ModelParallelDDP, ("ddp", "tp+cp"): ModelParallelDDP, ("fsdp2", "tp+cp"): ModelParallelFSDP2,
    ("zero1", "tp+cp"): ModelParallelDeepSpeed, ("zero2", "tp+cp"): ModelParallelDeepSpeed,
    ("zero3", "tp+cp"): ModelParallelZeRO3, ("fsdp1", "tp+cp"): _FSDP1,
    # EP x CP: experts drawn from the dp x cp ranks (each cp rank routes its own tokens), attention context-parallel
    ("single", "ep+cp"): ModelParallelDDP, ("ddp", "ep+cp"): ModelParallelDDP, ("fsdp2", "ep+cp"): ModelParallelFSDP2,
    ("zero1", "ep+cp"): ModelParallelDeepSpeed, ("zero2", "ep+cp"): ModelParallelDeepSpeed,
    ("zero3", "ep+cp"): ModelParallelZeRO3, ("fsdp1", "ep+cp"): _FSDP1,
    ("single", "tp+ep+cp"): ModelParallelDDP, ("ddp", "tp+ep+cp"): ModelParallelDDP,
    ("fsdp2", "tp+ep+cp"): ModelParallelFSDP2, ("zero1", "tp+ep+cp"): ModelParallelDeepSpeed,
    ("zero2", "tp+ep+cp"): ModelParallelDeepSpeed, ("zero3", "tp+ep+cp"): ModelParallelZeRO3, ("fsdp1", "tp+ep+cp"): _FSDP1,
    # pipeline parallelism: each rank one stage, its grads reduced over its dp group by hfpar or FSDP2 (fully_shard
    # over dp only); under TP each stage is tensor-parallel and activations travel between ranks of one tp coordinate
    ("single", "pp"): PipelineDDP, ("ddp", "pp"): PipelineDDP, ("fsdp2", "pp"): PipelineFSDP2, ("fsdp1", "pp"): _FSDP1,
    ("single", "tp+pp"): PipelineDDP, ("ddp", "tp+pp"): PipelineDDP, ("fsdp2", "tp+pp"): PipelineFSDP2,
    ("fsdp1", "tp+pp"): _FSDP1,
    ("zero1", "pp"): PipelineZeRO1, ("zero2", "pp"): _PP_ZERO, ("zero3", "pp"): _PP_ZERO,
    # ZeRO-1: each stage's optimizer state over its dp group; DeepSpeed's norm over the stages x TP ranks, experts
    # beside it (pipeline_zero.py)
    ("zero1", "tp+pp"): PipelineZeRO1, ("zero2", "tp+pp"): _PP_ZERO, ("zero3", "tp+pp"): _PP_ZERO,
    # EP x PP: each stage's MoE blocks expert-parallel over its dp group, routed per micro-batch (the sampler makes
    # a micro-batch of the dp ranks one slice of the global batch); experts reduced by hfpar, outside FSDP2's units
    ("single", "ep+pp"): PipelineDDP, ("ddp", "ep+pp"): PipelineDDP, ("fsdp2", "ep+pp"): PipelineFSDP2,
    ("fsdp1", "ep+pp"): _FSDP1, ("zero1", "ep+pp"): PipelineZeRO1, ("zero2", "ep+pp"): _PP_ZERO, ("zero3", "ep+pp"): _PP_ZERO,
    # PP x CP: each stage's attention context-parallel over its cp group, each micro-batch with its rows' layout
    ("single", "cp+pp"): PipelineDDP, ("ddp", "cp+pp"): PipelineDDP, ("fsdp2", "cp+pp"): PipelineFSDP2,
    ("fsdp1", "cp+pp"): _FSDP1, ("zero1", "cp+pp"): PipelineZeRO1, ("zero2", "cp+pp"): _PP_ZERO, ("zero3", "cp+pp"): _PP_ZERO,
    # a pipeline with two or three other model parallelisms: each stage tensor-parallel and / or expert-parallel
    # (experts drawn from its dp x cp ranks) and / or context-parallel, each as in the pairs above; ZeRO-1 as in its
    # TP x PP and EP x PP pairs (pipeline_zero.py takes whatever groups a stage has)
    **{(s, k): cls for k in _PP_MULTI for s, cls in (("single", PipelineDDP), ("ddp", PipelineDDP),
                                                      ("fsdp2", PipelineFSDP2), ("fsdp1", _FSDP1),
                                                      ("zero1", PipelineZeRO1),
                                                      ("zero2", _PP_ZERO),
                                                      ("zero3", _PP_ZERO))},
}

_FLAG = {"tp": "--tp_size", "ep": "--ep_size", "cp": "--cp_size", "pp": "--pp_size"}
_WHAT = {"tp": "tensor parallelism", "ep": "expert parallelism", "cp": "context parallelism",
         "pp": "pipeline parallelism"}


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


__all__ = ["SUPPORT", "STRATEGIES", "PARALLELISMS", "select_backend", "support_table_markdown", "Backend",
           "ModelParallelBackend", "AccelerateBackend", "ModelParallelDDP", "ModelParallelFSDP2",
           "ModelParallelDeepSpeed", "ModelParallelZeRO3", "PipelineBackend", "PipelineDDP", "PipelineFSDP2",
           "PipelineZeRO1",
           "STRATEGY", "Strategy", "checkpoint_layout", "resolve_strategy", "strategy_of"]
