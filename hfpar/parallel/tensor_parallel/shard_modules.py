"""The modules of a matched plan replaced or hooked in place, one style each (plans.py lists the styles).

    new = shard_modules(model, {"model.layers.0.self_attn.q_proj": "colwise", ...}, config=config, tp=2,
                        tp_group=group, sequence_parallel=False)      # {name: new layer}

apply_tensor_parallel calls it on the whole model, verify_first_block on one block's copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn as nn

from ..comm import group_rank
from ..sharding import ShardSpec, set_shard_spec, shard_spec, shard_tensor
from .conv1d import ColumnParallelConv1D, RowParallelConv1D, is_conv1d
from .heads import localize_heads
from .hooks import (
    HEAD_BIAS_ARGS,
    embed_scale_hook,
    enter_region_hook,
    gather_sequence_hook,
    local_head_bias_hook,
    scatter_sequence_hook,
)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .norms import ShardedRMSNorm
from .plans import packed_splits
from .rng import has_dropout, install_region_rng
from .shape_check import REGIONS as _REGIONS

__all__ = ["RegionColumnParallelLinear", "shard_modules"]


class RegionColumnParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear inside an "attention" / "mlp" region: the region's forward pre-hook has
    already brought its input into the TP region (copy, or the sequence all-gather under SP), so
    this layer does no collective of its own. Same parameters and export as the parent class."""

    in_region = True


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def shard_modules(
    model: nn.Module, assigned: Mapping[str, str], *, config, tp: int, tp_group, sequence_parallel: bool
) -> dict[str, nn.Module]:
    """Replace / hook every module of `assigned` ({name: style}, names relative to `model`) in place; returns the
    new layers by name. The whole model, or one block's copy for verify_first_block."""
    regions = [n for n, s in assigned.items() if s in _REGIONS]
    gathered = "sequence_gather" in assigned.values()
    new_modules: dict[str, nn.Module] = {}
    for name, style in assigned.items():
        if style == "head_param":  # (H, ...) by head: this rank's heads, like the projections' (export gathers)
            parent, _, leaf = name.rpartition(".")
            owner, full = model.get_submodule(parent), model.get_parameter(name)
            local = shard_tensor(full.detach(), 0, group_rank(tp_group), tp)
            setattr(
                owner,
                leaf,
                set_shard_spec(
                    nn.Parameter(local, requires_grad=full.requires_grad),
                    ShardSpec(kind="tp", group=tp_group, dim=0, size=tp),
                ),
            )
            continue
        if style == "output_param":  # replicated, its gradient already complete: not summed over TP
            set_shard_spec(model.get_parameter(name), ShardSpec(kind="replicated"))
            continue
        mod, base = model.get_submodule(name), style.partition(":")[0]
        if base == "vocab_embedding":
            new = VocabParallelEmbedding.from_embedding(mod, tp_group, name=name)  # output all-reduced, full T
            if hasattr(mod, "embed_scale"):  # Gemma's scaled embedding: forward(ids) * embed_scale
                new.register_buffer("embed_scale", torch.as_tensor(mod.embed_scale).detach().clone(), persistent=False)
                new.register_forward_hook(embed_scale_hook)
        elif base in ("colwise", "colwise_packed"):
            in_region = any(name.startswith(r + ".") for r in regions)
            kw = {
                "packed_splits": packed_splits(style, config),
                "name": name,
                "sequence_parallel": sequence_parallel and not in_region,
            }
            if is_conv1d(mod):  # GPT-2: keeps Conv1D's (in, out) layout
                new = ColumnParallelConv1D.from_conv1d(mod, tp_group, **kw)
                new.in_region = in_region
            else:
                cls = RegionColumnParallelLinear if in_region else ColumnParallelLinear
                new = cls.from_linear(mod, tp_group, **kw)
        elif base == "colwise_lm_head":  # under SP it gathers T itself, unless a sequence_gather did it before
            new = ColumnParallelLinear.from_linear(
                mod, tp_group, sequence_parallel=sequence_parallel and not gathered, name=name
            )
        elif base == "sharded_rmsnorm":  # a norm over all heads, on this rank's heads (norms.py)
            new = ShardedRMSNorm.from_norm(mod, tp_group, name=name)
        elif base == "rowwise" and is_conv1d(mod):
            new = RowParallelConv1D.from_conv1d(mod, tp_group, sequence_parallel=sequence_parallel, name=name)
        elif base == "rowwise_heads":  # reduce-scatter along the output features: this rank's heads' values
            new = RowParallelLinear.from_linear(
                mod, tp_group, input_is_parallel=True, sequence_parallel=True, sequence_dim=-1, name=name
            )
        elif base == "rowwise":
            new = RowParallelLinear.from_linear(
                mod, tp_group, input_is_parallel=True, sequence_parallel=sequence_parallel, name=name
            )
        else:
            if base in _REGIONS:
                mod.register_forward_pre_hook(
                    partial(enter_region_hook, group=tp_group, name=name, sequence_parallel=sequence_parallel),
                    with_kwargs=True,
                )
                if has_dropout(mod):  # this rank's heads / features draw masks of their own (rng.py)
                    install_region_rng(mod, group_rank(tp_group))
            if base in ("attention", "attention_widths"):
                localize_heads(mod, config, tp, widths=base == "attention_widths")
                params = list(inspect.signature(mod.forward).parameters)
                bias_args = [a for a in params if a in HEAD_BIAS_ARGS]
                if bias_args and getattr(config, "num_attention_heads", None):  # ALiBi for all heads (Bloom, MPT)
                    mod.register_forward_pre_hook(
                        partial(
                            local_head_bias_hook,
                            names=bias_args,
                            tp=tp,
                            group=tp_group,
                            heads=config.num_attention_heads,
                            positions={a: params.index(a) for a in bias_args},
                        ),
                        with_kwargs=True,
                    )
            elif base == "sequence_gather" and sequence_parallel:
                mod.register_forward_pre_hook(
                    partial(gather_sequence_hook, group=tp_group, name=name), with_kwargs=True
                )
            elif base == "sequence_scatter" and sequence_parallel:
                mod.register_forward_pre_hook(
                    partial(scatter_sequence_hook, group=tp_group, tp=tp, name=name), with_kwargs=True
                )
                # every block then holds this rank's T/tp tokens: its dropouts draw per rank too (rng.py)
                stack = model.get_submodule(name.rpartition(".")[0]) if "." in name else None
                if isinstance(stack, nn.ModuleList) and any(has_dropout(b) for b in stack):
                    for b in stack:
                        install_region_rng(b, group_rank(tp_group))
            elif base == "replicated_heads" or (base == "replicated_sp" and sequence_parallel):
                for p in mod.parameters():  # replicated; each rank's grad covers its tokens / heads only
                    set_shard_spec(p, ShardSpec(kind="replicated", partial_grad_group=tp_group))
            continue
        new.train(mod.training)
        new_modules[name] = new
        _set_submodule(model, name, new)  # now: the full weight is freed layer by layer (peak ~ model + 1 layer)
    whole = {id(model.get_parameter(n)) for n, s in assigned.items() if s == "output_param"}
    for r in regions:  # other parameters inside a region act on this rank's heads / features: partial grads
        _mark_region_replicated(model.get_submodule(r), tp_group, whole)
    return new_modules


def _mark_region_replicated(region: nn.Module, tp_group, whole: set[int] = frozenset()) -> None:
    """Replicated parameters a region applies to its local heads / intermediate features (q/k norms without a plan
    entry, a learnable activation such as Apertus' xIELU): each rank's gradient covers its part, so it is summed
    over TP. One that acts across all heads instead (forward not exact) is caught by verify_first_block."""
    for m in region.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ShardedRMSNorm)):
            continue
        for p in m.parameters(recurse=False):
            spec = shard_spec(p)
            if id(p) in whole:  # output_param: applied after the region's all-reduce
                continue
            if spec is None or (spec.kind == "replicated" and spec.partial_grad_group is None):
                set_shard_spec(p, ShardSpec(kind="replicated", partial_grad_group=tp_group))
