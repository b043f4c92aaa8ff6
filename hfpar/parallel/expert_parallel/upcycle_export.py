"""An upcycled model written as the HF MoE architecture that computes what it computes (upcycle_check.export_target:
Mixtral for Llama / Mistral, Qwen3-MoE for Qwen3, FlexOlmo for OLMo-2, ...).

    save_upcycled_pretrained(model, out)          # collective; AutoModelForCausalLM.from_pretrained(out) loads it
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM

from ..comm import group_rank
from .moe import MoELayer
from .params import gather_expert_state_dict
from .upcycle import is_upcycled
from .upcycle_check import export_config, export_target

__all__ = ["upcycled_hf_config", "save_upcycled_pretrained"]


def upcycled_hf_config(model: nn.Module):
    """The HF MoE config an upcycled model is exported as (export_target of its dense config): the dense config's
    shared fields + num experts, top_k, router_aux_loss_coef, the experts' intermediate size."""
    if not is_upcycled(model):
        raise ValueError("upcycled_hf_config: the model was not converted by upcycle_to_moe")
    src = model.config
    target = export_target(src)
    if isinstance(target, str):
        raise ValueError(f"upcycled_hf_config: this {src.model_type} model cannot be exported: {target}")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    n_layers = getattr(src, "num_hidden_layers", len(layers))
    if len(layers) != n_layers:
        raise ValueError(
            f"upcycled_hf_config: {target.model_type} cannot represent this {src.model_type} model: "
            f"{len(layers)} MoE layers for {n_layers} decoder layers"
        )
    router = layers[0].gate
    return export_config(
        src, target, router.num_experts, router.top_k, router.aux_loss_coef, layers[0].experts.intermediate_size
    )


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
