"""A tensor-parallel plan verified on a tiny copy of the model when the model itself has no weights yet.

    rel = verify_on_tiny_copy(model, plan, tp_group, sequence_parallel=False)   # model: a meta skeleton

The recipes' sharded loading applies TP to the meta skeleton, before any weight is read, so block_check.py has no
weights to run the first block with. Building the real blocks with random weights would cost the real embedding
(GBs for a 150k vocabulary) and float64 copies of a real block (GBs for a 30B MoE layer) before loading. A plan's
correctness is a matter of structure, not of size: the same plan patterns are matched on a tiny float64 copy of the
model (its own class, its config shrunk by hfpar.parallel.tiny_copy: every kind of layer it has, its features kept:
windows, activation sparsity, MoE, hybrid layers), sharded over the SAME tp group, and verify_first_block runs there
on every block structure and the last block, forward and backward, at 1e-6. A plan that would train the model
wrongly (Gemma-3n's activation-sparse MLPs, whose Gaussian top-k statistics span the whole intermediate width) is
refused in one line before the weights are read; the model is left unsharded.

Head counts of the copy are raised to a multiple of tp where the tiny sizes (4 heads, 2 key-value heads) do not
divide (tp 4, 8). Where no tiny copy can be had (custom code, a family that cannot shrink, a copy whose sizes the
plan cannot divide), the plan is applied unverified with one warning naming why, as before.

Cost: building the copy (~0.1-0.5 s on CPU) and block_check on its blocks (milliseconds), once per apply.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..comm import group_size
from ..errors import ParallelError
from ..language_model import text_config
from ..tiny_copy import PROBE_SHRINK, SHRINK, TINY, runnable, tiny_like
from .block_check import verify_first_block
from .shape_check import drop_empty_regions, match_plan, validate_degrees
from .shard_modules import shard_modules

__all__ = ["on_meta", "verify_on_tiny_copy"]

# head-count fields of the tiny copy that tp must divide (raised to a multiple of tp where they do not)
_HEAD_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "kv_n_heads",
    "n_head",
    "n_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_num_heads",
    "mamba_n_heads",
    "mamba_num_heads",
)


def on_meta(model: nn.Module) -> bool:
    """Whether the model is (partly) a meta skeleton: its weights not read yet."""
    return any(p.is_meta for p in model.parameters())


def heads_for(tp: int) -> dict[str, int]:
    """Head-count sizes of the tiny copy that tp divides (an empty dict at tp <= 2: the tiny sizes already do)."""
    sizes = {**TINY, **SHRINK, **PROBE_SHRINK}
    return {k: math.lcm(v, tp) for k in _HEAD_FIELDS if isinstance(v := sizes.get(k), int) and v % tp}


def verify_on_tiny_copy(
    model: nn.Module,
    plan: Mapping[str, str],
    tp_group,
    *,
    optional: tuple[str, ...] = (),
    drop_empty: bool = False,
    sequence_parallel: bool = False,
    warn: bool = True,
) -> float | None:
    """Refuse (ParallelError, one line) when `plan`, matched on a tiny float64 copy of `model` and sharded over
    `tp_group`, does not reproduce the unsharded copy's blocks (block_check.verify_first_block: every block
    structure and the last). Returns the worst relative difference; where no copy could be checked, 0.0 with one
    warning saying why, or None without it (warn=False: the caller verifies otherwise). Collective over tp_group:
    every rank builds the same copy (seed 0) and decides the same."""
    tp = group_size(tp_group)
    model_type = getattr(text_config(getattr(model, "config", None)), "model_type", None)
    try:
        tiny = tiny_like(model, extra=heads_for(tp))
    except Exception as e:  # noqa: BLE001 - whatever the family raises when shrunk: unverified, with a warning
        first = str(e).splitlines()[0][:120] if str(e) else ""
        tiny = f"its tiny copy could not be built ({type(e).__name__}: {first})"
    if not isinstance(tiny, str):
        if dist.get_backend(tp_group) == "nccl":  # the collectives run on this rank's GPU
            tiny = tiny.to(torch.device("cuda", torch.cuda.current_device()))
        tiny = runnable(tiny)  # float32 where the family cannot run float64
        cfg = text_config(tiny.config)
        try:
            matched = match_plan(tiny, plan, optional, allow_unmatched=True)  # a kind of module the copy lacks
            matched = drop_empty_regions(matched) if drop_empty else matched
            inp, out = tiny.get_input_embeddings(), tiny.get_output_embeddings()
            tied = inp is not None and out is not None and out.weight is inp.weight
            validate_degrees(tiny, matched, cfg, tp, sequence_parallel, tied)
        except ValueError as e:
            tiny = f"the plan does not fit its tiny copy ({str(e)[:160]})"
    if isinstance(tiny, str) and not warn:
        return None
    if isinstance(tiny, str):
        warnings.warn(
            f"apply_tensor_parallel: the plan is not verified (the weights are on the meta device and {tiny})",
            stacklevel=3,
        )
        return 0.0
    shard = partial(shard_modules, config=cfg, tp=tp, tp_group=tp_group, sequence_parallel=sequence_parallel)
    try:
        return verify_first_block(
            tiny,
            {n: s for n, (s, _) in matched.items()},
            shard,
            tp_group,
            sequence_parallel=sequence_parallel,
            model_type=model_type,
        )
    except ParallelError as e:
        err = ParallelError(
            e.where,
            [f"{e.detail} (checked on a tiny float64 copy of the model's config: its weights are not read yet)"],
        )
        err.module = getattr(e, "module", None)
        raise err from e
