"""Can hfpar's context parallelism shard this model? Decided by what the model does, not by its name.

    problems = cp_attention_problems(config)       # [] or one line per module / feature it cannot honour

The model is built from (a copy of) its config on the meta device (no memory, no weights) with a recording function
as its attention implementation (MoE blocks: transformers' batched_mm experts, which run on meta tensors), and runs
one training-mode forward on a few meta tokens with explicit position ids.
CP works by replacing that function (transformers' attention registry, `config._attn_implementation`): so every
attention module must have called it, and with nothing hfpar's CP attention cannot honour:
    - a module that computes attention itself (never calls the registered function): refused, named;
    - attention dropout, attention sinks (`s_aux`), non-causal attention: refused, named;
    - sliding windows (`sliding_window=`, per layer) and logit soft-capping (`softcap=`): implemented.
Position ids: the model's forward must take `position_ids` (hfpar passes each token's global position there).
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

# under a ZeRO-3 launch, from_config would build the probe inside deepspeed.zero.Init (which cannot copy meta
# tensors); transformers' own marker for "zero.Init is already active" keeps the probe a plain meta model
from transformers.modeling_utils import set_zero3_state

from ..language_model import language_model, language_model_path

PROBE = "hfpar_cp_probe"
SUPPORTED_KWARGS = ("sliding_window", "softcap")  # honoured (kernel_calls.py / blockwise.py)
REFUSED_KWARGS = {"s_aux": "attention sinks (s_aux)"}  # would be silently dropped: refused


def _record(calls):
    def probe(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        calls.append((module, dropout, kwargs))
        b, h, t, _ = query.shape  # (B, T, H, Dv): value's head dim (MLA: Dv != Dqk)
        return query.new_empty(b, t, h, value.shape[-1]), None

    return probe


def cp_attention_problems(config, tokens: int = 8) -> list[str]:
    """One line per attention module / feature of `config`'s causal LM that hfpar's CP attention cannot honour."""
    calls: list = []
    AttentionInterface.register(PROBE, _record(calls))
    name = (getattr(config, "architectures", None) or [getattr(config, "model_type", "model")])[0]
    try:
        with set_zero3_state(), torch.device("meta"):
            # a copy: from_config records both implementations on the config it gets. batched_mm experts (MoE
            # families): grouped_mm refuses fp32 on CPU and eager indexes by data (nonzero), neither runs on meta
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=PROBE, experts_implementation="batched_mm"
            )
        if "position_ids" not in inspect.signature(model.forward).parameters:
            return [
                (
                    f"{name}: its forward takes no position_ids, which context parallelism needs (each token's "
                    "global position)"
                )
            ]
        model.train()
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        pos = torch.arange(tokens, device="meta")[None]
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos)
    except Exception as exc:  # noqa: BLE001 - any failure means the model could not be checked: refuse, say why
        return [
            (
                f"{name}: could not check how its attention is computed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); context parallelism needs attention through transformers' "
                "attention registry"
            )
        ]
    called = {id(m) for m, _, _ in calls}
    problems = []
    lm_path = language_model_path(model)  # a multimodal wrapper: its towers are not the sharded sequence
    for mod_name, mod in language_model(model).named_modules(prefix=lm_path):
        if (
            type(mod).__name__.endswith("Attention")
            and id(mod) not in called
            and not any(id(sub) in called for sub in mod.modules())
            and not _inside_called(model, mod_name, called)
        ):
            problems.append(
                f"{type(mod).__name__} ({mod_name}) computes attention itself instead of calling "
                "transformers' attention registry (attn_implementation), which context parallelism "
                "replaces"
            )
            break
    seen = set()
    for module, dropout, kwargs in calls:
        cls = type(module).__name__
        feats = [REFUSED_KWARGS[k] for k in REFUSED_KWARGS if kwargs.get(k) is not None]
        if dropout:
            feats.append(f"attention dropout {dropout} (set attention_dropout 0)")
        if getattr(module, "is_causal", True) is False:
            feats.append("non-causal attention")
        for f in feats:
            if (cls, f) not in seen:
                seen.add((cls, f))
                problems.append(f"{cls} uses {f}, which hfpar's context-parallel attention does not implement")
    if not calls and not problems:
        problems.append(
            f"{name}: no module called transformers' attention registry (attn_implementation); "
            "context parallelism replaces that function, so it cannot shard this model"
        )
    return problems


def _inside_called(model, mod_name: str, called: set) -> bool:
    """True when an enclosing module of `mod_name` called the registry (an Attention wrapper around a core)."""
    parts = mod_name.split(".")
    return any(id(model.get_submodule(".".join(parts[:i]))) in called for i in range(1, len(parts)))
