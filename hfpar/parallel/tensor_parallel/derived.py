"""Tensor-parallel plans derived from transformers' own `config.base_model_tp_plan`, for families hfpar has no
written plan for (plans.py). The result is an ordinary hfpar plan, validated like a written one.

    python -c "from transformers import AutoConfig, AutoModelForCausalLM as M; \
from hfpar.parallel.tensor_parallel.derived import derive_plan; \
print(derive_plan(M.from_config(AutoConfig.for_model('granite', num_hidden_layers=1))))"

HF style (transformers 5 configs)   hfpar style
    colwise                         colwise, in a region: its parent module becomes 'attention' (a module
                                    named *attn* / *attention*: per-rank heads) or 'mlp'
    rowwise                         rowwise (the region's output projection)
    packed_colwise on a Linear      colwise_packed:gate_up | colwise_packed:qkv (by the module's name)
    replicated_with_grad_allreduce  replicated_heads (q/k norms over head_dim on the local heads; grads summed)
    embedding_rowwise               vocab_embedding
    and always: the input embedding -> vocab_embedding, the output embedding -> colwise_lm_head (vocab shards,
    loss by vocab_parallel_cross_entropy through model.loss_function; optional, task heads stay replicated)
Routed experts (HF's `*.experts*` entries, moe_tp_experts) are left out: MoE blocks stay whole on every TP rank,
split by expert parallelism instead (apply_expert_parallel / --ep_size); their attention is tensor-parallel.
Refused, in one line naming the family and the entry: colwise_gather_output / rowwise_split_input (HF gathers
the heads because a norm spans all of them, e.g. olmo2's q_norm; hfpar keeps activations head-sharded), MLA,
local_* and every other style. Derived plans are TP only:
sequence parallelism needs the hand-written plans (their norms and first-layer split are named explicitly).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .plans import TP_PLANS

__all__ = ["HF_STYLES", "derive_plan", "derived_plan_problem"]

HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "replicated_heads",
             "embedding_rowwise": "vocab_embedding", "packed_colwise": "colwise_packed"}
_WHY = {"colwise_gather_output": "HF gathers the heads back (a norm spans all heads); hfpar keeps them sharded",
        "rowwise_split_input": "pairs with colwise_gather_output",
        "moe_tp_experts": "MoE experts: use apply_expert_parallel", "mla_kv_a_proj": "multi-head latent attention"}
_ATTN_LEAVES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn", "query_key_value", "Wqkv")


def _refuse(model_type: str, key: str, style: str, why: str) -> ValueError:
    return ValueError(f"apply_tensor_parallel: cannot derive a tensor-parallel plan for model_type {model_type!r} "
                      f"from its base_model_tp_plan: entry {key!r}: {style!r} has no hfpar equivalent ({why}); "
                      f"pass plan={{module pattern: style}}")


def _packed_rule(key: str) -> str | None:
    leaf = key.rpartition(".")[2]
    return "gate_up" if "gate_up" in leaf else "qkv" if "qkv" in leaf else None


def _dense(hf: Mapping[str, str]) -> dict[str, str]:
    """HF's entries without the routed experts (`...experts` and below): hfpar's TP leaves MoE blocks whole on
    every TP rank and expert parallelism splits them (their routers and shared experts stay replicated too)."""
    return {k: s for k, s in hf.items() if "experts" not in k.split(".") and not s.startswith("moe_")}


def _problem(model_type, hf: Mapping[str, str]) -> str | None:
    if not hf:
        return (f"apply_tensor_parallel: model_type {model_type!r} has no hfpar plan and its config no "
                f"base_model_tp_plan (written plans: {', '.join(sorted(TP_PLANS))}; others derived from "
                f"base_model_tp_plan); pass plan={{module pattern: style}}")
    for key, style in _dense(hf).items():
        if style not in HF_STYLES:
            return str(_refuse(model_type, key, style, _WHY.get(style, "unknown to hfpar")))
        if style == "packed_colwise" and _packed_rule(key) is None:
            return str(_refuse(model_type, key, style, "packed parts of an unknown layout"))
    return None


def derived_plan_problem(config) -> str | None:
    """Why no plan can be derived from this config (None: it can). Needs no model (for a preflight)."""
    return _problem(getattr(config, "model_type", None), getattr(config, "base_model_tp_plan", None) or {})


def _prefix(model: nn.Module) -> str:
    """Where the base model sits in a task model (`model.` for LlamaForCausalLM, `transformer.` for GPT-2)."""
    name = getattr(model, "base_model_prefix", "")
    return f"{name}." if name and isinstance(getattr(model, name, None), nn.Module) else ""


def derive_plan(model: nn.Module, hf_plan: Mapping[str, str] | None = None) -> dict[str, str]:
    """An hfpar plan from `model.config.base_model_tp_plan` (or `hf_plan`); ValueError in one line naming the
    family and the first entry that cannot map."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    hf = dict(hf_plan if hf_plan is not None else getattr(config, "base_model_tp_plan", None) or {})
    problem = _problem(model_type, hf)
    if problem is not None:
        raise ValueError(problem)
    prefix = _prefix(model)
    plan: dict[str, str] = {}
    parents: dict[str, list[str]] = {}
    for key, style in _dense(hf).items():
        path, ours = prefix + key, HF_STYLES[style]
        if ours == "colwise_packed":
            ours = f"colwise_packed:{_packed_rule(key)}"
        plan[path] = ours
        if ours.startswith(("colwise", "rowwise")):
            parent, _, leaf = path.rpartition(".")
            parents.setdefault(parent, []).append(leaf)
    for parent, leaves in parents.items():   # each parent of column/row layers is one TP region
        tail = parent.rpartition(".")[2].lower()
        if tail in ("*", "") or tail.isdigit():   # a decoder layer: its input also feeds the residual
            raise ValueError(f"apply_tensor_parallel: cannot derive a tensor-parallel plan for model_type "
                             f"{model_type!r}: {leaves} sit directly in {parent!r} (hfpar needs the attention / MLP "
                             f"module around them as the TP region); pass plan={{module pattern: style}}")
        attn = "attn" in tail or "attention" in tail or any(leaf in _ATTN_LEAVES for leaf in leaves)
        plan[parent] = "attention" if attn else "mlp"
    names = {id(m): n for n, m in model.named_modules()}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inp is not None and id(inp) in names:
        plan[names[id(inp)]] = "vocab_embedding"
    if isinstance(out, nn.Linear) and id(out) in names:
        plan[names[id(out)]] = "colwise_lm_head"
    return plan
