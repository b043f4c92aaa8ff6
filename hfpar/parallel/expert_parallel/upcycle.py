"""Dense -> MoE upcycling: every SwiGLU MLP becomes E copies of itself behind a new router (the export as an HF MoE
architecture: upcycle_export.py; which one: upcycle_check.py).

    dense = AutoModelForCausalLM.from_pretrained("a llama")
    upcycle_to_moe(dense, num_experts=8, top_k=2)        # at init the model still computes the dense function
    save_upcycled_pretrained(dense, out)                 # collective; a Mixtral checkpoint

The MLPs are found by what they hold, not by their family: a module with gate_proj / up_proj / down_proj Linear
layers (no bias) is a SwiGLU MLP, down(act(gate(x)) * up(x)), act the config's hidden_act (or hidden_activation);
upcycle_check verifies on a tiny copy of the config that the upcycled model computes the dense function.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .apply import _new_router
from .families import config_num_experts
from .moe import GroupedExperts, MoELayer

__all__ = ["upcycle_to_moe", "is_upcycled", "dense_mlps", "mlp_activation"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def dense_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every SwiGLU MLP of `model`: gate_proj / up_proj / down_proj, each an nn.Linear."""
    return [
        (path, m)
        for path, m in model.named_modules()
        if all(isinstance(getattr(m, n, None), nn.Linear) for n in PROJECTIONS)
    ]


def mlp_activation(config) -> str | None:
    """The activation of the model's MLPs, as its config names it (hidden_act; Gemma: hidden_activation)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
    return act if isinstance(act, str) else None


# ----------------------------------------------------------------------------- upcycling
@torch.no_grad()
def upcycle_to_moe(
    model: nn.Module,
    num_experts: int,
    top_k: int = 2,
    *,
    aux_loss_coef: float = 0.01,
    z_loss_coef: float = 0.0,
    router_init_std: float = 0.02,
    seed: int = 0,
    dp_group=None,
) -> nn.Module:
    """Turn every dense SwiGLU MLP (dense_mlps) into a MoELayer of `num_experts` copies of it with a
    new router (normal(0, router_init_std), drawn from `seed` alone, so identical on every rank). The
    top-k weights are renormalized to sum to 1, so at init the model computes the dense function.
    dp_group: the routers' statistics group (None: this process; apply_expert_parallel sets it).
    Returns `model`, changed in place; `model.config` stays the dense config (see upcycled_hf_config)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is not None and config_num_experts(config) is not None:
        raise ValueError(f"upcycle_to_moe: this {model_type} model has experts already (a MoE config)")
    mlps = dense_mlps(model)
    act = mlp_activation(config) if config is not None else None
    problems = []
    if not mlps:
        problems.append(f"no SwiGLU MLP (gate_proj / up_proj / down_proj Linear layers) in this {model_type} model")
    if act is None:
        problems.append(
            f"its config names no hidden_act / hidden_activation for the MLPs (got {type(config).__name__})"
        )
    if not 1 <= top_k <= num_experts:
        problems.append(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
    biased = [path for path, m in mlps if any(getattr(m, n).bias is not None for n in PROJECTIONS)]
    if biased:
        problems.append(
            f"{biased[0]} and {len(biased) - 1} more: projections with bias are not supported (mlp_bias=True)"
        )
    if problems:
        raise ValueError("upcycle_to_moe: " + "; ".join(problems))
    gen = torch.Generator().manual_seed(seed)
    for path, m in mlps:
        w_gate, w_up, w_down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight  # (I, H), (I, H), (H, I)
        I, H = w_gate.shape
        w = torch.randn(num_experts, H, generator=gen, dtype=torch.float32) * router_init_std  # (E, H)
        device = (
            w_gate.device if not w_gate.is_meta else "cpu"
        )  # a meta skeleton (hfpar.loading.sharded): a real router
        router = _new_router(
            w.to(device=device, dtype=w_gate.dtype),
            num_experts,
            top_k,
            norm_topk_prob=True,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            group=dp_group,
        )
        with torch.device("meta"):
            experts = GroupedExperts(num_experts, H, I, act)
        gate_up = torch.cat([w_gate, w_up], dim=0)  # (2I, H)
        experts.gate_up_proj = nn.Parameter(gate_up[None].repeat(num_experts, 1, 1))  # (E, 2I, H)
        experts.down_proj = nn.Parameter(w_down.detach()[None].repeat(num_experts, 1, 1))  # (E, H, I)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, MoELayer(router, experts))
    return model


def is_upcycled(model: nn.Module) -> bool:
    """A dense model (its config declares no experts) whose MLPs upcycle_to_moe turned into MoELayers."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and config_num_experts(config) is None
        and any(isinstance(m, MoELayer) for m in model.modules())
    )
