"""Can hfpar's context parallelism shard this model? Decided by what the model does, not by its name.

    problems = cp_attention_problems(config)       # [] or one line per module / feature it cannot honour

The model is built from (a copy of) its config on the meta device (no memory, no weights) with a recording function
as its attention implementation (MoE blocks: transformers' batched_mm experts, which run on meta tensors), and runs
one training-mode forward on a few meta tokens with explicit position ids. A family whose forward the meta device
cannot run (GPT-2 and DBRX read values: `.item()`, `nonzero`) is probed on its tiny copy instead (real values, its
attention-dropout fields kept). After this probe, shard_check.py runs the tiny copy cut over emulated cp ranks.
CP works by replacing that function (transformers' attention registry, `config._attn_implementation`): so every
attention module must have called it, and with nothing hfpar's CP attention cannot honour:
    - a module that computes attention itself (never calls the registered function): refused, named;
    - attention dropout, non-causal attention, keys other than the row's tokens (more keys than queries: DeepSeek-V4's
      compressed keys): refused, named;
    - sliding windows (`sliding_window=`, per layer), logit soft-capping (`softcap=`) and attention sinks (`s_aux=`,
      GPT-OSS): implemented.
Position ids: the model's forward must take `position_ids` (hfpar passes each token's global position there).
"""

from __future__ import annotations

import copy
import inspect

import torch
import transformers  # its modeling code is imported when a probe runs (cp > 1), not by the preflight's import

from ..language_model import language_model, language_model_path
from ..tiny_copy import LAYERS, PROBE_SHRINK, shrink

PROBE = "hfpar_cp_probe"
_NEEDS = "context parallelism needs attention through transformers' attention registry"
SUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")  # honoured (kernel_calls.py / blockwise.py / fused.py)


def _record(calls):
    def probe(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        keys = key.shape[-2] if key.shape[-2] != query.shape[-2] else None  # meta shapes are known
        calls.append((module, dropout, keys))
        b, h, t, _ = query.shape  # (B, T, H, Dv): value's head dim (MLA: Dv != Dqk)
        return query.new_zeros(b, t, h, value.shape[-1]), None

    return probe


def _probed(config, calls: list, tokens: int, tiny: bool):
    """The model of `config` after one training-mode forward with the recording attention: on the meta device at
    its own sizes, or (tiny) its tiny copy on CPU, for families whose forward reads a value (`.item()`, `nonzero`)
    or copies a tensor the meta device cannot give. Raises what the family raises."""
    calls.clear()
    # under a ZeRO-3 launch, from_config would build the probe inside deepspeed.zero.Init (which cannot copy meta
    # tensors); transformers' own marker for "zero.Init is already active" keeps the probe a plain meta model
    with transformers.modeling_utils.set_zero3_state():
        if tiny:  # real values, sizes shrunk, dropout kept: the meta probe's answer for a family meta cannot run
            cfg = shrink(copy.deepcopy(config), LAYERS, extra=PROBE_SHRINK)
            for k, v in _dropouts(config).items():
                setattr(cfg.get_text_config(), k, v)
            device = torch.device("cpu")
        else:
            cfg, device = copy.deepcopy(config), torch.device("meta")
        with device:
            # a copy: from_config records both implementations on the config it gets. batched_mm experts (MoE
            # families): grouped_mm refuses fp32 on CPU and eager indexes by data (nonzero), neither runs on meta
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=PROBE, experts_implementation="batched_mm"
            )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return model
    model.train()
    ids = torch.full((1, tokens), 3, dtype=torch.long, device=device)
    pos = torch.arange(tokens, device=device)[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    return model


def _dropouts(config) -> dict:
    """The text config's attention-dropout fields (the tiny copy zeroes every dropout; the probe must see them)."""
    text = config.get_text_config()
    return {
        k: v
        for k, v in vars(text).items()
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k) and ("att" in k or "attn" in k)
    }


def cp_attention_problems(config, tokens: int = 8) -> list[str]:
    """One line per attention module / feature of `config`'s causal LM that hfpar's CP attention cannot honour."""
    calls: list = []
    transformers.AttentionInterface.register(PROBE, _record(calls))
    name = (getattr(config, "architectures", None) or [getattr(config, "model_type", "model")])[0]
    try:
        try:
            model = _probed(config, calls, tokens, tiny=False)
        except Exception:  # noqa: BLE001 - the meta device cannot run it: its tiny copy, with real values
            model = _probed(config, calls, tokens, tiny=True)
    except KeyError as exc:  # Falcon, GPT-Neo: an attention class picked from a table of the family's own
        if exc.args and exc.args[0] == PROBE:
            return [
                (
                    f"{name}: its attention modules are picked from a table of its own by attn_implementation "
                    "(eager / sdpa / flash_attention_2), not transformers' attention registry, which context "
                    "parallelism replaces"
                )
            ]
        return [f"{name}: could not check how its attention is computed (KeyError: {exc}); {_NEEDS}"]
    except Exception as exc:  # noqa: BLE001 - any failure means the model could not be checked: refuse, say why
        return [
            (
                f"{name}: could not check how its attention is computed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); {_NEEDS}"
            )
        ]
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return [
            (
                f"{name}: its forward takes no position_ids, which context parallelism needs (each token's "
                "global position)"
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
    for module, dropout, keys in calls:
        cls = type(module).__name__
        feats = []
        if keys is not None:  # DeepSeek-V4: compressed keys beside the row's own
            feats.append(f"keys of its own making ({keys} keys for {tokens} queries: compressed or extra)")
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
