"""A TP plan checked against a model's names and shapes (no compute, before any collective): which module each
pattern names, and whether its dimensions divide by tp; every problem collected, raised once.

    matched = match_plan(model, get_plan("llama"))         # {module name: (style, pattern)}
    validate_degrees(model, matched, model.config, tp=2, sequence_parallel=False, tied=False)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ParallelError
from .conv1d import is_conv1d
from .heads import config_heads
from .norms import rmsnorm_problem
from .plans import PARAM_STYLES, compile_pattern, packed_splits

# attention_widths: an attention region whose module also holds all the heads' width (heads x head_dim) as an
# attribute its forward splits or reshapes by (DBRX's hidden_size, XGLM's embed_dim): localized with the heads
ATTENTION = ("attention", "attention_widths")
REGIONS = (*ATTENTION, "mlp")


# ----------------------------------------------------------------------------- validation
class _Problems:
    """Collects every problem (one entry per issue and plan pattern, first module named), raises once, in one line."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], list[str]] = {}

    def add(self, where: str, what: str, pattern: str | None = None) -> None:
        self.items.setdefault((pattern or where, what), []).append(where)

    def raise_if_any(self, tp: int) -> None:
        if not self.items:
            return
        lines = [
            f"{w[0]}: {what}" + (f" (same for {len(w) - 1} more module(s) matching {pat!r})" if len(w) > 1 else "")
            for (pat, what), w in self.items.items()
        ]
        raise ParallelError(f"apply_tensor_parallel (tp_size {tp})", lines)  # one line


def moe_block_names(model: nn.Module) -> list[str]:
    """Modules holding routed experts: an `experts` child with 3-D weights (E, ., .) (hfpar's MoELayer, the HF
    sparse blocks of transformers 5). Tensor parallelism leaves them whole on every TP rank (their input is the
    replicated residual stream); expert parallelism (--ep_size) is what splits them."""
    names = []
    for name, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if isinstance(experts, nn.Module) and any(p.dim() == 3 for p in experts.parameters(recurse=False)):
            names.append(name)
    return names


def lookup_only(emb: nn.Module | None) -> bool:
    """An nn.Embedding whose forward is the lookup (Gemma's scaled one: its scale is re-applied after the all-reduce).
    One that computes more (Inkling's embedding RMSNorm) stays replicated, and with it a head tied to it."""
    return isinstance(emb, nn.Embedding) and (type(emb).forward is nn.Embedding.forward or hasattr(emb, "embed_scale"))


def match_plan(
    model: nn.Module, plan: Mapping[str, str], optional: tuple[str, ...] = (), allow_unmatched: bool = False
) -> dict[str, tuple[str, str]]:
    """{module name: (style, pattern)} for every module a pattern matches; every pattern must match,
    except those whose style is in `optional` (built-in plans: the LM head, absent from task heads such
    as *ForSequenceClassification, whose small head then stays replicated and its logits full) and, with
    allow_unmatched, any (a plan derived from HF's names every layer kind of a family, e.g. the dense MLPs of
    a model whose MLPs are all MoE). Modules inside MoE blocks (moe_block_names) count as matched but are
    left out: they stay replicated over TP."""
    compiled = [(p, compile_pattern(p), s) for p, s in plan.items()]
    moe = tuple(moe_block_names(model))
    hits = {p: 0 for p in plan}
    out: dict[str, tuple[str, str]] = {}
    params = [n for n, _ in model.named_parameters()] if any(s in PARAM_STYLES for s in plan.values()) else []
    for name in [n for n, _ in model.named_modules()] + params:
        found = [
            (p, s) for p, rx, s in compiled if name and rx.fullmatch(name) and (s in PARAM_STYLES) == (name in params)
        ]
        if len(found) > 1:
            raise ParallelError("apply_tensor_parallel", [f"module {name} matches several plan entries {found}"])
        if found:
            hits[found[0][0]] += 1
            if not any(name == b or name.startswith(b + ".") for b in moe):
                out[name] = (found[0][1], found[0][0])
    missing = [p for p, n in hits.items() if n == 0 and plan[p].partition(":")[0] not in optional]
    if missing and not allow_unmatched:
        raise ParallelError(
            "apply_tensor_parallel",
            [
                f"plan pattern(s) {missing} match no module of "
                f"{type(model).__name__} (the built-in plans expect an HF *ForCausalLM model, "
                f"unwrapped); pass plan= for other layouts"
            ],
        )
    return out


def drop_empty_regions(matched: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """A derived / inferred region pattern can match a module built differently from the one the plan describes
    (MiniMax's linear-attention layers share the name `self_attn` with its full-attention layers): where none of the
    plan's projections sit inside it, the module stays whole and replicated (exact; its blocks are verified too)."""
    proj = ("colwise", "colwise_packed", "rowwise", "rowwise_heads")
    empty = [
        r
        for r, (s, _) in matched.items()
        if s in REGIONS
        and not any(n.startswith(r + ".") and t.partition(":")[0] in proj for n, (t, _) in matched.items())
    ]
    return {n: v for n, v in matched.items() if not any(n == r or n.startswith(r + ".") for r in empty)}


def _acts_as_linear(mod: nn.Module, known: dict[type, bool]) -> bool:
    """An nn.Linear, or a subclass that only re-spells its forward (Falcon's FalconLinear: x @ W.T + b): no other
    parameter, buffer or child, and on a random input the same output as F.linear (checked once per class, on the
    first module of it). A subclass that computes anything else keeps its forward: refused by the caller."""
    if not isinstance(mod, nn.Linear):
        return False
    if type(mod).forward is nn.Linear.forward:
        return True
    cls = type(mod)
    if cls not in known:
        own = {n for n, _ in mod.named_parameters(recurse=False)} - {"weight", "bias"}
        ok = not own and not list(mod.children()) and not list(mod.buffers())
        if ok:
            gen = torch.Generator().manual_seed(0)
            if mod.weight.is_meta:  # a meta skeleton (sharded loading): a copy with random values
                mod = copy.deepcopy(mod)
                for n, p in list(mod.named_parameters()):
                    setattr(mod, n, nn.Parameter(torch.randn(p.shape, generator=gen).to(p.dtype)))
            x = torch.randn(3, mod.in_features, generator=gen).to(mod.weight)
            with torch.no_grad():
                ok = torch.allclose(mod(x), F.linear(x, mod.weight, mod.bias), rtol=1e-5, atol=1e-6)
        known[cls] = ok
    return known[cls]


def validate_degrees(
    model: nn.Module, matched: dict[str, tuple[str, str]], config, tp: int, sequence_parallel: bool, tied: bool
) -> None:
    """Every divisibility / type problem, before any collective."""
    pr = _Problems()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if tp > world:
        pr.add("tp group", f"tp_size {tp} is larger than the world size {world}")
    assigned = {n: s for n, (s, _) in matched.items()}
    linear_types: dict[type, bool] = {}
    for name, (style, pat) in matched.items():
        add = partial(pr.add, name, pattern=pat)
        if style in PARAM_STYLES:
            n = model.get_parameter(name).shape[0]
            if style == "head_param" and n % tp:
                add(f"its {n} heads (dim 0) are not divisible by tp_size {tp}")
            continue
        mod, base = model.get_submodule(name), style.partition(":")[0]
        if base in REGIONS:  # every Linear / Embedding inside a region must be sharded by the plan
            for sub, m in mod.named_modules(prefix=name):
                if (isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)) and sub not in matched:
                    add(
                        f"{sub} ({type(m).__name__}) is inside the TP region {name!r} but has no plan entry "
                        f"(its input gradient would be summed over the TP ranks)"
                    )
        if base in ATTENTION and config is not None:
            nh, nkv = config_heads(config, mod)
            for field, n in (("num_attention_heads", nh), ("num_key_value_heads", nkv)):
                if n % tp:
                    add(f"{field} {n} is not divisible by tp_size {tp}")
        elif base == "mlp":
            n = getattr(mod, "intermediate_size", None) or getattr(config, "intermediate_size", None)
            if n is not None and n % tp:
                add(f"intermediate_size {n} is not divisible by tp_size {tp}")
        elif base == "sharded_rmsnorm":
            why = rmsnorm_problem(mod, tp)
            if why:
                add(why)
        elif base == "vocab_embedding":
            if not isinstance(mod, nn.Embedding):
                add(f"style {style!r} needs an nn.Embedding, found {type(mod).__name__}")
            elif type(mod).forward is not nn.Embedding.forward and not hasattr(mod, "embed_scale"):
                add(f"{type(mod).__name__} overrides nn.Embedding.forward; its extra computation would be lost")
            elif mod.num_embeddings % tp:
                add(f"vocab_size {mod.num_embeddings} is not divisible by tp_size {tp}")
        elif base in ("colwise", "colwise_packed", "colwise_lm_head", "rowwise", "rowwise_heads"):
            conv = base != "colwise_lm_head" and is_conv1d(mod)
            if not conv and not _acts_as_linear(mod, linear_types):
                add(
                    f"style {style!r} needs a plain nn.Linear{'' if base == 'colwise_lm_head' else ' or Conv1D'}, "
                    f"found {type(mod).__name__}"
                )
                continue
            n_in, n_out = (mod.nx, mod.nf) if conv else (mod.in_features, mod.out_features)
            if base == "rowwise_heads" and (conv or mod.bias is not None or n_out % tp):
                add(f"style {style!r} needs an nn.Linear without bias and out_features divisible by tp_size {tp}")
            if base in ("rowwise", "rowwise_heads"):
                if n_in % tp:
                    add(f"in_features {n_in} is not divisible by tp_size {tp}")
                continue
            what = "vocab_size" if base == "colwise_lm_head" else "out_features"
            if n_out % tp:
                add(f"{what} {n_out} is not divisible by tp_size {tp}")
            splits = packed_splits(style, config)
            if splits is not None:
                if sum(splits) != n_out:
                    add(f"packed splits {splits} ({style}) sum to {sum(splits)}, not out_features {n_out}")
                elif any(s % tp for s in splits):
                    add(f"packed splits {splits} ({style}) are not all divisible by tp_size {tp}")
    styles = set(s.partition(":")[0] for s in assigned.values())
    if sequence_parallel and "sequence_scatter" not in styles:
        pr.add("plan", "sequence_parallel=True needs a 'sequence_scatter' entry (the first decoder layer)")
    if tied:
        emb = [n for n, s in assigned.items() if s == "vocab_embedding"]
        head = [n for n, s in assigned.items() if s == "colwise_lm_head"]
        if len(emb) != 1 or len(head) != 1:
            pr.add(
                "tie_word_embeddings",
                "tied input/output embeddings need exactly one 'vocab_embedding' and one "
                f"'colwise_lm_head' entry in the plan (found {emb} and {head})",
            )
    pr.raise_if_any(tp)
