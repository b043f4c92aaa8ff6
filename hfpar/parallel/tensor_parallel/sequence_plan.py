"""Sequence parallelism for plans hfpar did not write (derived from base_model_tp_plan, inferred from the modules):
the entries a written plan names by hand, read from the model's structure.

    plan = sequence_parallel_plan(model, derive_plan(model))

    <blocks>.0               sequence_scatter   the residual stream is split along T on entry to the first block
    <blocks>.*.<child>       replicated_sp      every other parametrised child of a block outside the TP regions
                                                (norms): it runs on this rank's T/tp tokens, its grad is summed over TP
    <base>.<final>           sequence_gather    the one parametrised module after the blocks (the final norm): T is
                                                all-gathered before it, so it and the LM head run on the full sequence
                                                (GPT-2-style models view the output to the input's (B, T) there)

What this cannot see (a block child that mixes tokens, such as linear attention kept whole; a block of another
structure) the apply-time verification catches: every distinct block structure runs sharded on T/tp tokens against
the unsharded block (block_check.py), and the plan is refused in one line if any differs. MoE blocks are refused with
sequence parallelism by apply_tensor_parallel (their experts route the full sequence).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..errors import ParallelError
from .block_check import first_block_name
from .shape_check import REGIONS, match_plan

__all__ = ["sequence_parallel_plan"]


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """`plan` plus the sequence-parallel entries above; ValueError in one line when the structure does not fit."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    assigned = {n: s for n, (s, _) in match_plan(model, plan, ("colwise_lm_head",), allow_unmatched=True).items()}
    first = first_block_name(assigned)
    if first is None:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"sequence_parallel for model_type {mt!r}: its plan shards no "
                "decoder block (no attention / MLP region); use TP without sequence_parallel"
            ],
        )
    blocks, base = first.rpartition(".")[0], first.rpartition(".")[0].rpartition(".")
    out = dict(plan)
    out[first] = "sequence_scatter"
    taken = {p.rpartition(".")[2] for p, s in plan.items() if s.partition(":")[0] in REGIONS}
    for block in model.get_submodule(blocks):
        for child, m in block.named_children():
            key = f"{blocks}.*.{child}"
            if child not in taken and key not in plan and _has_params(m):
                out[key] = "replicated_sp"
    root = model.get_submodule(base[0]) if base[0] else model
    tail = [n for n, m in root.named_children() if n != base[2] and not isinstance(m, nn.Embedding) and _has_params(m)]
    if len(tail) != 1:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"sequence_parallel for model_type {mt!r}: expected one module with "
                f"parameters after {blocks} (the final norm), found {tail}; use TP without sequence_parallel"
            ],
        )
    out[f"{base[0]}.{tail[0]}" if base[0] else tail[0]] = "sequence_gather"
    return out
