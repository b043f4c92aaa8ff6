"""Sharded loading of an upcycled model (--upcycle_experts): each rank builds only its experts from the dense MLP.

    model = build_skeleton(cls, path, index)            # a dense checkpoint (Llama / Mistral / Qwen3), on meta
    upcycle_to_moe(model, 8); apply_expert_parallel(model, ctx, check_replicated=False)   # experts on meta, E/ep
    load_upcycled_experts(model, index)                 # called by hfpar.loading.sharded.load_sharded first

Every expert of an upcycled layer is a copy of the dense MLP it replaces (gate_up = [gate; up], down), so this
rank's E/ep experts are E/ep copies of the three dense weights, read once per layer (whole: the MoE blocks stay
whole on TP ranks). The full path (from_pretrained, upcycle: all E copies, then EP keeps E/ep) holds E copies of
every MLP first. The routers are drawn from --seed alone at upcycling (on CPU, whatever the dense weights' device),
so they equal the full path's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hfpar.loading.files import Files, read
from hfpar.loading.views import hf_view
from hfpar.parallel.expert_parallel.moe import MoELayer
from hfpar.parallel.sharding import set_shard_spec, shard_spec

__all__ = ["load_upcycled_experts"]

_DENSE = ("gate_proj", "up_proj", "down_proj")


def _upcycled_layers(model: nn.Module, index: dict[str, str]) -> list[tuple[nn.Module, list[str]]]:
    """(experts module, its dense checkpoint keys gate / up / down) of every MoE layer still on meta whose dense
    MLP the checkpoint holds (a native MoE checkpoint has per-expert keys instead: hfpar.loading.sharded reads
    those)."""
    _, hf_name = hf_view(model)
    out = []
    for path, m in model.named_modules():
        if not isinstance(m, MoELayer) or not m.experts.gate_up_proj.is_meta:
            continue
        mlp = hf_name(f"{path}.experts.gate_up_proj").removesuffix(".experts.gate_up_proj")
        keys = [f"{mlp}.{p}.weight" for p in _DENSE]
        if all(k in index for k in keys):
            out.append((m.experts, keys))
    return out


def _put(module: nn.Module, leaf: str, value: torch.Tensor) -> None:
    old = getattr(module, leaf)
    new = nn.Parameter(value.to(old.dtype).contiguous(), requires_grad=old.requires_grad)
    if shard_spec(old) is not None:
        set_shard_spec(new, shard_spec(old))
    setattr(module, leaf, new)


@torch.no_grad()
def load_upcycled_experts(model: nn.Module, index: dict[str, str]) -> int:
    """Fill this rank's experts of every upcycled layer (on meta) with copies of its dense MLP; bytes read."""
    layers = _upcycled_layers(model, index)
    files = Files(index, [k for _, keys in layers for k in keys])
    done = 0
    for experts, keys in layers:
        gate, up, down = (read(files, k, None) for k in keys)  # (I, H), (I, H), (H, I)
        done += sum(t.numel() * t.element_size() for t in (gate, up, down))
        n = experts.gate_up_proj.shape[0]  # this rank's experts, E/ep
        _put(experts, "gate_up_proj", torch.cat([gate, up], dim=0)[None].expand(n, -1, -1))  # (E/ep, 2I, H)
        _put(experts, "down_proj", down[None].expand(n, -1, -1))  # (E/ep, H, I)
    return done
