"""Where PEFT's LoRA adapters will sit, decided on the model as transformers builds it, before any hfpar layer replaces
its modules (tensor parallelism: its parallel layers are no nn.Linear to PEFT; MoE: hfpar's layers compute the routers
and experts themselves):

    config = resolve_lora_config(config, model)   # PEFT's own resolution of the targets on this (unsplit) model
    paths = adapter_paths(model, config)          # the modules that will hold an adapter, parameter adapters included
    at = adapters_in_moe_blocks(model, config)    # those hfpar's MoE conversion would bypass (a router, the experts)
    why = ep_lora_problem(hf_config, config, ep)  # before the model loads: the same, on the config's tiny copy

PEFT resolves a config's targets inside get_peft_model, in two steps this replays on a copy of the config: under
transformers 5 it first maps a MoE family's targets onto the fused 3-D expert weights (`target_parameters`, PEFT's
ParamWrapper; "all-linear" there also reaches the routers' and experts' weights), then expands "all-linear" to the
model's nn.Linear / Conv1D module names (here without the modules PEFT saves whole: saved_whole). Resolving only the
second step (what hfpar did before) put no adapter on the experts under --tp_size, where one process puts them there:
a different model trained.
Written here because PEFT has no public call that returns the resolved config without building the adapters.
"""

from __future__ import annotations

import copy
import re

import torch

from hfpar.parallel.expert_parallel import inside, moe_replaced_paths
from hfpar.parallel.tiny_copy import tiny_model

__all__ = [
    "adapter_paths",
    "adapters_in_moe_blocks",
    "ep_lora_problem",
    "ep_lora_refusal",
    "resolve_lora_config",
    "saved_whole",
]


def resolve_lora_config(config, model: torch.nn.Module):
    """A copy of the LoraConfig `config` with target_modules / target_parameters (and the rank / alpha patterns a fused
    expert weight gets) as PEFT's get_peft_model resolves them on `model` (the HF model, before TP or MoE layers)."""
    # peft is imported on use: an optional extra that costs ~2.8 s per process (hfpar.loading.lora)
    from peft.import_utils import is_transformers_ge_v5  # noqa: PLC0415
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers  # noqa: PLC0415

    config = copy.deepcopy(config)
    if is_transformers_ge_v5 and hasattr(getattr(model, "config", None), "model_type"):  # as BaseTuner.inject_adapter
        from peft.utils.transformers_weight_conversion import (  # noqa: PLC0415 (transformers 5 only)
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )

        convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    all_linear = isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"
    config = _maybe_include_all_linear_layers(config, model)
    if all_linear and (saved := saved_whole(config)):  # DistilBERT's pre_classifier: a Linear PEFT also saves whole
        config.target_modules = {t for t in config.target_modules if not any(t.endswith(s) for s in saved)}
    return config


def saved_whole(config) -> list[str]:
    """The module names PEFT trains and saves whole (modules_to_save; a SEQ_CLS model's head: PeftModelForSequence-
    Classification adds "classifier" and "score"), matched as PEFT's _set_trainable matches them (a plain suffix:
    "pre_classifier" ends with "classifier"). PEFT cannot put LoRA on such a module as well (a TypeError), so
    "all-linear" leaves them out: the head is trained whole, as its name asks."""
    saved = list(config.modules_to_save or [])
    if getattr(config, "task_type", None) == "SEQ_CLS":  # PEFT's TaskType is a str enum
        saved += ["classifier", "score"]
    return saved


def adapter_paths(model: torch.nn.Module, config) -> list[str]:
    """Paths of the modules of `model` PEFT puts an adapter on under the resolved `config`: those its target_modules
    match, and those holding a parameter its target_parameters match (PEFT's ParamWrapper), in the model's order."""
    from peft.tuners.tuners_utils import check_target_module_exists  # noqa: PLC0415 (optional extra)

    params = sorted(config.target_parameters or ())
    out = []
    for path, module in model.named_modules():
        if not path:
            continue
        if config.target_modules is not None and check_target_module_exists(config, path):
            out.append(path)
        elif any(_param_match(f"{path}.{n}", params) for n, _ in module.named_parameters(recurse=False)):
            out.append(path)
    return out


def _param_match(key: str, targets: list[str]) -> bool:  # BaseTuner._inject_parameters' rule
    return key in targets or any(key.endswith(f".{t}") for t in targets)


def adapters_in_moe_blocks(model: torch.nn.Module, config) -> list[str]:
    """Adapter paths (adapter_paths) inside what hfpar's MoE conversion takes over (moe_replaced_paths: a block's
    router and experts, not its shared experts): with them the blocks must stay the HF model's own."""
    replaced = moe_replaced_paths(model)
    return [p for p in adapter_paths(model, config) if inside(p, replaced)] if replaced else []


def ep_lora_refusal(ep: int, path: str) -> str:
    """The one line refusing adapters on what expert parallelism computes (it needs hfpar's MoE layers)."""
    return (
        f"--use_peft with --ep_size {ep}: LoRA adapters sit on what expert parallelism computes ({path}: a router "
        "or the experts); name --lora_target_modules outside the MoE blocks' routers and experts (e.g. "
        "q_proj,k_proj,v_proj,o_proj), or drop --ep_size"
    )


def ep_lora_problem(hf_config, lora_config, ep: int) -> str | None:
    """ep_lora_refusal before the model loads, decided on the config's tiny copy (hfpar.parallel.tiny_copy: every
    kind of layer, the same module classes; its layer indices are not the model's, so the path names the layer `*`).
    None where the copy cannot be built: apply_moe refuses the same once the model is loaded."""
    try:
        model = tiny_model(copy.deepcopy(hf_config))
        at = [] if isinstance(model, str) else adapters_in_moe_blocks(model, resolve_lora_config(lora_config, model))
    except Exception:  # noqa: BLE001 - a family the copy cannot build, or targets PEFT rejects: decided after loading
        return None
    return ep_lora_refusal(ep, re.sub(r"\.\d+\.", ".*.", at[0], count=1)) if at else None
