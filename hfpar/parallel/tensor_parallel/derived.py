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
    colwise_gather_output           HF gathers the full projection back (a norm spans every head, or a packed
      + rowwise_split_input         layout HF cannot split): hfpar keeps the heads sharded instead: colwise
                                    (packed by the leaf's name) / rowwise, and the parent's RMSNorms as wide as
                                    a column output become sharded_rmsnorm (norms.py: sum of squares all-reduced)
    colwise_gather_output alone     (no rowwise_split_input beside it: Qwen3-Next / Qwen3.5 linear attention) the
                                    module stays whole and replicated on every rank: exact, not sharded
    colwise on a parameter          head_param (attention sinks (H,), Beam's per-head gate bias: split by head)
    local_params                    nothing (HF uses the module's DTensors as local tensors; hfpar's are local)
    replicate                       nothing (the module whole on every rank; Inkling-2's embedding)
    all_reduce                      nothing (HF sums the module's output over TP, InklingSharedExperts': the hfpar
                                    region around its colwise / rowwise children does that; verified)
    rowwise on a Linear with one    rowwise_heads (Doge's dt_proj: all value heads -> one value per kv head; the
      output per head               rank keeps its heads' values), and the region's parameters of that length
                                    (Doge's A) head_param
    mla_kv_a_proj                   replicated_heads (multi-head latent attention: the latent down-projections,
                                    and the parent's other unlisted Linears such as q_a_proj, stay replicated with
                                    their partial gradients summed; the per-head up-projections colwise, o rowwise)
                                    (unlisted Linears of a region's nested submodules: the same, verified)
Refused, in one line naming the family and the entry: local_* and every other style. Derived plans are TP only:
sequence parallelism needs the hand-written plans (their norms and first-layer split are named explicitly).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ParallelError, Problem
from ..language_model import language_model_path, text_config
from .heads import head_count_values
from .plans import TP_PLANS, compile_pattern
from .shape_check import lookup_only

__all__ = ["HF_STYLES", "derive_plan", "derived_plan_problem", "derived_plan_refusal"]

HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "replicated_with_grad_allreduce": "replicated_heads",
    "embedding_rowwise": "vocab_embedding",
    "packed_colwise": "colwise_packed",
}
_WHY = {"moe_tp_experts": "MoE experts: use apply_expert_parallel"}
_MAPPED = (
    "replicate",
    "colwise_gather_output",
    "rowwise_split_input",
    "mla_kv_a_proj",
    "local_params",
    "all_reduce",
)  # in derive_plan
_ATTN_LEAVES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn", "query_key_value", "Wqkv")


_OWN_PLAN = "pass plan={module pattern: style}"


def _refuse(model_type: str, key: str, style: str, why: str) -> ParallelError:
    return ParallelError(
        "apply_tensor_parallel",
        [
            Problem(
                f"cannot derive a tensor-parallel plan for model_type {model_type!r} from its base_model_tp_plan: "
                "entry "
                f"{key!r}: {style!r} has no hfpar equivalent ({why})",
                _OWN_PLAN,
            )
        ],
    )


def _packed_rule(key: str) -> str | None:
    leaf = key.rpartition(".")[2]
    return "gate_up" if "gate_up" in leaf else "qkv" if "qkv" in leaf else None


def _dense(hf: Mapping[str, str]) -> dict[str, str]:
    """HF's entries without the routed experts (`...experts` and below): hfpar's TP leaves MoE blocks whole on
    every TP rank and expert parallelism splits them (their routers and shared experts stay replicated too)."""
    return {k: s for k, s in hf.items() if "experts" not in k.split(".") and not s.startswith("moe_")}


def _refusal(model_type, hf: Mapping[str, str]) -> ParallelError | None:
    if not hf:
        return ParallelError(
            "apply_tensor_parallel",
            [
                Problem(
                    f"model_type {model_type!r} has no hfpar plan and its config no base_model_tp_plan (written plans: "
                    f"{', '.join(sorted(TP_PLANS))}; others derived from base_model_tp_plan)",
                    _OWN_PLAN,
                )
            ],
        )
    for key, style in _dense(hf).items():
        if style not in HF_STYLES and style not in _MAPPED:
            return _refuse(model_type, key, style, _WHY.get(style, "unknown to hfpar"))
        if style == "packed_colwise" and _packed_rule(key) is None:
            return _refuse(model_type, key, style, "packed parts of an unknown layout")
    return None


def derived_plan_refusal(config) -> ParallelError | None:
    """Why no plan can be derived from this config, as the error derive_plan would raise (None: it can, or the config
    has no base_model_tp_plan and apply_tensor_parallel infers one from the modules, verified or refused there:
    infer.py). Needs no model."""
    hf = getattr(config, "base_model_tp_plan", None) or {}
    return _refusal(getattr(config, "model_type", None), hf) if hf else None


def derived_plan_problem(config) -> str | None:
    """derived_plan_refusal's one-line message, or None."""
    refusal = derived_plan_refusal(config)
    return None if refusal is None else str(refusal)


def _prefix(model: nn.Module, hf: Mapping[str, str] | None = None) -> str:
    """Where the base model sits in a task model (`model.` for LlamaForCausalLM, `transformer.` for GPT-2). Where
    base_model_prefix names no child (Llama4ForCausalLM's is `language_model`, its decoder sits in `model`): the
    direct child in which the most of HF's entries match a module (their first component names a child of it)."""
    lm_path = language_model_path(model)  # a multimodal wrapper: HF's entries are relative to its language model
    if lm_path:
        return f"{lm_path}."
    name = getattr(model, "base_model_prefix", "")
    if name and isinstance(getattr(model, name, None), nn.Module):
        return f"{name}."
    heads = {k.split(".", 1)[0] for k in hf or ()}
    if heads and not any(isinstance(getattr(model, h, None), nn.Module) for h in heads):
        scored = [
            (sum(isinstance(getattr(child, h, None), nn.Module) for h in heads), n)
            for n, child in model.named_children()
        ]
        best = max(scored, default=(0, ""))
        if best[0]:
            return f"{best[1]}."
    return ""


def derive_plan(model: nn.Module, hf_plan: Mapping[str, str] | None = None) -> dict[str, str]:
    """An hfpar plan from `model.config.base_model_tp_plan` (or `hf_plan`); ValueError in one line naming the
    family and the first entry that cannot map."""
    config = text_config(model.config)  # a multimodal wrapper's plan is its language model's (language_model.py)
    model_type = getattr(config, "model_type", None)
    hf = dict(hf_plan if hf_plan is not None else getattr(config, "base_model_tp_plan", None) or {})
    refusal = _refusal(model_type, hf)
    if refusal is not None:
        raise refusal
    prefix = _prefix(model, hf)
    plan: dict[str, str] = {}
    parents: dict[str, list[str]] = {}
    dense = _dense(hf)
    by_parent: dict[str, set[str]] = {}
    for key, style in dense.items():
        by_parent.setdefault(key.rpartition(".")[0], set()).add(style)
    for key, style in dense.items():
        kinds = by_parent[key.rpartition(".")[0]]
        if "colwise_gather_output" in kinds and "rowwise_split_input" not in kinds:
            continue  # HF keeps the module's output whole: hfpar leaves the module replicated (exact)
        path = prefix + key
        if style == "local_params":  # HF: the module's DTensor parameters used as local tensors; hfpar's are local
            continue
        if style == "all_reduce":  # HF: the module's output summed over TP; an hfpar region does that itself
            continue
        if style == "replicate":  # HF: the module whole on every rank, as hfpar leaves a module it has no entry for
            continue
        if style == "colwise" and _is_parameter(model, path):  # attention sinks, a per-head gate bias
            plan[path] = "head_param"
            continue
        if style == "mla_kv_a_proj":
            plan[path] = "replicated_heads"
            continue
        ours = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}.get(style) or HF_STYLES[style]
        if ours == "colwise" and style == "colwise_gather_output" and _packed_rule(key):
            ours = "colwise_packed"
        if ours == "colwise_packed":
            ours = f"colwise_packed:{_packed_rule(key)}"
        if ours == "rowwise" and _per_head_output(model, path):
            ours = "rowwise_heads"
        plan[path] = ours
        if ours.startswith(("colwise", "rowwise")):
            parent, _, leaf = path.rpartition(".")
            parents.setdefault(parent, []).append(leaf)
    _complete_regions(model, plan, parents, dense, prefix)
    for parent, leaves in parents.items():  # each parent of column/row layers is one TP region
        tail = next((c for c in reversed(parent.lower().split(".")) if c != "*" and not c.isdigit()), "")
        if _is_decoder_layer(model, parent):  # its input also feeds the residual
            raise ParallelError(
                "apply_tensor_parallel",
                [
                    Problem(
                        f"cannot derive a tensor-parallel plan for model_type {model_type!r}: {leaves} sit directly in "
                        f"{parent!r} (hfpar needs the attention / MLP module around them as the TP region)",
                        _OWN_PLAN,
                    )
                ],
            )
        attn = "attn" in tail or "attention" in tail or any(leaf in _ATTN_LEAVES for leaf in leaves)
        plan[parent] = "attention" if attn else "mlp"
    names = {id(m): n for n, m in model.named_modules()}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = inp is not None and out is not None and getattr(out, "weight", None) is getattr(inp, "weight", None)
    if inp is not None and id(inp) in names:
        if lookup_only(inp):
            plan[names[id(inp)]] = "vocab_embedding"
        else:  # replicated (HF's embedding_rowwise entry for it is dropped too)
            plan = {
                k: v
                for k, v in plan.items()
                if not (v == "vocab_embedding" and compile_pattern(k).fullmatch(names[id(inp)]))
            }
    if isinstance(out, nn.Linear) and id(out) in names and (lookup_only(inp) or not tied):
        plan[names[id(out)]] = "colwise_lm_head"
    return plan


def _is_decoder_layer(model: nn.Module, parent: str) -> bool:
    """Whether the region pattern names a decoder layer (`layers.*`: an element of the layer stack, the only list
    index in its name), not a module of a list inside one (LongCat-Flash's two attentions per layer,
    `layers.*.self_attn.*`)."""
    tail = parent.rpartition(".")[2]
    if tail not in ("*", "") and not tail.isdigit():
        return False
    rx = compile_pattern(parent)
    first = next((n for n, _ in model.named_modules() if rx.fullmatch(n)), parent)
    return sum(part.isdigit() for part in first.split(".")) <= 1


def _head_counts(model: nn.Module) -> set[int]:
    return head_count_values(text_config(model.config))


def _per_head_output(model: nn.Module, pattern: str) -> bool:
    """A rowwise Linear whose output is one value per (kv) head, not the model width (Doge's dt_proj)."""
    rx = compile_pattern(pattern)
    m = next((m for n, m in model.named_modules() if rx.fullmatch(n)), None)
    hidden = getattr(text_config(model.config), "hidden_size", None)
    return isinstance(m, nn.Linear) and m.out_features in _head_counts(model) and m.out_features != hidden


def _is_parameter(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` names a parameter (HF's `layers.*.self_attn.sinks`) in any module its parent matches (MiMo-V2-
    Flash's sinks exist in its sliding-window layers only: `sinks = None` in the others)."""
    parent, _, leaf = pattern.rpartition(".")
    rx = compile_pattern(parent)
    return any(isinstance(m._parameters.get(leaf), nn.Parameter) for n, m in model.named_modules() if rx.fullmatch(n))


def _complete_regions(
    model: nn.Module, plan: dict[str, str], parents: dict[str, list[str]], dense: Mapping[str, str], prefix: str
) -> None:
    """Entries HF's plan leaves implicit, read from the first module each region pattern matches: RMSNorms as wide
    as one of the region's column outputs (a norm over all heads: sharded_rmsnorm); in a multi-head latent attention
    the other Linears (q_a_proj), and anywhere the Linears of a nested submodule (DeepSeek-V3.2's sparse-attention
    indexer, whose output is integer token indices): replicated_heads. That is a proposal: replicated with its
    gradient summed over TP is exact only when the Linear feeds this rank's heads (q_a_proj) or no gradient at all
    (the indexer); the apply-time verification (block_check.py) refuses the plan otherwise."""
    mla = {prefix + k.rpartition(".")[0] for k, s in dense.items() if s == "mla_kv_a_proj"}
    names = [n for n, _ in model.named_modules()]
    for parent, leaves in parents.items():
        rx = compile_pattern(parent)
        first = next((n for n in names if rx.fullmatch(n)), None)
        if first is None:
            continue
        mod = model.get_submodule(first)
        widths = {getattr(getattr(mod, leaf, None), "out_features", None) for leaf in leaves}
        head_dim = getattr(mod, "head_dim", None)
        for child, m in mod.named_children():
            key = f"{parent}.{child}"
            if key in plan:
                continue
            w = getattr(m, "weight", None)
            if (
                "RMSNorm" in type(m).__name__
                and isinstance(w, torch.Tensor)
                and w.dim() == 1
                and w.numel() in widths
                and w.numel() != head_dim
            ):
                plan[key] = "sharded_rmsnorm"
        per_head = [
            getattr(getattr(mod, leaf, None), "out_features", None)
            for leaf in leaves
            if plan.get(f"{parent}.{leaf}") == "rowwise_heads"
        ]
        for n, p in mod.named_parameters(recurse=False):  # Doge's A (one per kv head) beside its dt_proj
            if per_head and p.dim() >= 1 and p.shape[0] in per_head and f"{parent}.{n}" not in plan:
                plan[f"{parent}.{n}"] = "head_param"
        for sub, m in mod.named_modules():  # Linears HF's plan leaves replicated inside the region
            key = f"{parent}.{sub}"
            if sub and key not in plan and isinstance(m, nn.Linear) and (parent in mla or "." in sub):
                plan[key] = "replicated_heads"
