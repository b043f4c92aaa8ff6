"""Dense -> MoE upcycling: every SwiGLU MLP becomes E copies of itself behind a new router, exported as the
matching HF MoE architecture (Mixtral for Llama / Mistral, Qwen3-MoE for Qwen3).

    dense = AutoModelForCausalLM.from_pretrained("a llama")
    upcycle_to_moe(dense, num_experts=8, top_k=2)        # at init the model still computes the dense function
    save_upcycled_pretrained(dense, out)                 # collective; a Mixtral checkpoint
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..comm import group_rank
from .apply import UPCYCLE_FAMILIES, _new_router, gather_expert_state_dict
from .moe import GroupedExperts, MoELayer

__all__ = ["upcycle_to_moe", "upcycled_hf_config", "save_upcycled_pretrained", "is_upcycled"]


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
    """Turn every dense SwiGLU MLP (UPCYCLE_FAMILIES) into a MoELayer of `num_experts` copies of it with a
    new router (normal(0, router_init_std), drawn from `seed` alone, so identical on every rank). The
    top-k weights are renormalized to sum to 1, so at init the model computes the dense function.
    dp_group: the routers' statistics group (None: this process; apply_expert_parallel sets it).
    Returns `model`, changed in place; `model.config` stays the dense config (see upcycled_hf_config)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = UPCYCLE_FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(
            f"upcycle_to_moe: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(sorted(UPCYCLE_FAMILIES))})"
        )
    mlps = [(p, m) for p, m in model.named_modules() if type(m).__name__ == fam.mlp_class]
    problems = []
    if not mlps:
        problems.append(f"no {fam.mlp_class} module found in this {model_type} model")
    if not 1 <= top_k <= num_experts:
        problems.append(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
    for path, m in mlps:
        if any(getattr(m, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            problems.append(f"{path}: projections with bias are not supported (mlp_bias=True)")
    if problems:
        raise ValueError("upcycle_to_moe: " + "; ".join(problems))
    gen = torch.Generator().manual_seed(seed)
    act = model.config.hidden_act
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
    """A dense architecture (config unchanged) whose MLPs upcycle_to_moe turned into MoELayers."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in UPCYCLE_FAMILIES and any(isinstance(m, MoELayer) for m in model.modules())


def upcycled_hf_config(model: nn.Module):
    """The HF MoE config (MixtralConfig for llama / mistral, Qwen3MoeConfig for qwen3) an upcycled model
    is exported as: the dense config's shared fields + num experts, top_k, router_aux_loss_coef."""
    if not is_upcycled(model):
        raise ValueError("upcycled_hf_config: the model was not converted by upcycle_to_moe")
    src, fam = model.config, UPCYCLE_FAMILIES[model.config.model_type]
    problems = [f"{n}=True" for n in fam.not_exportable if getattr(src, n, False)]
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    n_layers = getattr(src, "num_hidden_layers", len(layers))
    if len(layers) != n_layers:
        problems.append(f"{len(layers)} MoE layers for {n_layers} decoder layers")
    if problems:
        raise ValueError(
            f"upcycled_hf_config: {fam.export_model_type} cannot represent this {src.model_type} model: "
            + ", ".join(problems)
        )
    router = layers[0].gate
    target = type(AutoConfig.for_model(fam.export_model_type))
    names = {f.name for f in dataclasses.fields(target)} - {"architectures", "transformers_version", "model_type"}
    kw = {k: v for k, v in src.to_dict().items() if k in names}
    kw.update(
        {
            fam.export_num_experts: router.num_experts,
            "num_experts_per_tok": router.top_k,
            "router_aux_loss_coef": router.aux_loss_coef,
            "output_router_logits": False,
        }
    )
    kw.update({n: layers[0].experts.intermediate_size for n in fam.export_intermediate})
    kw.update(fam.export_constants)
    return AutoConfig.for_model(fam.export_model_type, **kw)


def save_upcycled_pretrained(
    model: nn.Module, save_directory: str, state_dict: dict | None = None, is_main_process: bool | None = None, **kwargs
) -> None:
    """Write an upcycled model as a standard HF MoE checkpoint (upcycled_hf_config); its state-dict keys
    already are the MoE architecture's (mlp.gate.weight, mlp.experts.gate_up_proj / down_proj).
    Collective when `state_dict` is None (gather_expert_state_dict); rank 0 writes by default."""
    cfg = upcycled_hf_config(model)
    sd = gather_expert_state_dict(model) if state_dict is None else state_dict
    if is_main_process is None:
        is_main_process = group_rank(None) == 0
    if not is_main_process:
        return
    with torch.device("meta"):  # a shell that only writes config + sd
        shell = AutoModelForCausalLM.from_config(cfg)
    shell.save_pretrained(save_directory, state_dict=sd, **kwargs)
