"""Which HF modules are MoE blocks hfpar can make expert-parallel: architectures as data, then generic detection.

    blocks, problems = find_moe_blocks(model)        # [MoEBlock(path, module, fam, E, k)], one-line problems

MOE_FAMILIES names the sparse block class of each known model_type and the config fields to read.
Any other model_type is detected generically: a module holding
    experts   a child with 3-D parameters gate_up_proj (E, 2I, H) [gate; up] and down_proj (E, H, I), nothing else
    router    a child whose only state is `weight` (E, H) (named gate / router; top_k from it, the block or config)
    [shared_expert(s)]   an MLP added to the routed output, [shared_expert_gate] Linear(H, 1): sigmoid gate
and, because a generic module's forward is unknown, the first block of each class is PROBED: the original block
and its hfpar equivalent (softmax top-k, renormalized or not, act = config.hidden_act) run on the same random
tokens in eval mode and must agree (fp32 / fp64: 1e-4 relative; 16-bit: 5e-2). What does not fit (biases,
bias-corrected / sigmoid / group-limited routing of DeepSeek-V3, GPT-OSS's transposed clamped experts, Phi-MoE's
sparsemixer) goes through hf_experts.py instead (the HF block's own code, only its experts sharded), which
apply_expert_parallel tries when these problems are found. Tested generically: flex_olmo, minimax, granitemoe
(tests/distributed/test_ep_hf_semantics.py); every family: benchmarks/moe/ep_family_sweep.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..language_model import text_config
from .hf_experts import find_hf_experts
from .moe import MoELayer

__all__ = [
    "MOE_FAMILIES",
    "MoEBlock",
    "MoEFamily",
    "config_num_experts",
    "find_moe_blocks",
    "has_moe_blocks",
    "inside",
]

# the config fields transformers' MoE configs name their routed-expert count with (DBRX: in its ffn_config;
# Ernie-4.5-MoE: moe_num_experts); config_num_experts is the one reader of them in hfpar
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoEFamily:
    """How to read one HF sparse MoE block. Config fields are attribute names of `model.config`;
    `norm_topk_prob` may be a constant. The block must hold `router.weight` (E, H) and 3-D experts
    `gate_up_proj` (E, 2I, H) [gate; up] / `down_proj` (E, H, I) with act = config.hidden_act."""

    block: str  # class name of the sparse block
    num_experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    norm_topk_prob: str | bool = "norm_topk_prob"
    jitter: str | None = None  # HF jitters the block input, hfpar the router input only
    router: str = "gate"  # module attributes of the block
    experts: str = "experts"
    shared_expert: str | None = None  # an MLP module, kept as is (replicated)
    shared_expert_gate: str | None = None  # Linear(H, 1): out += sigmoid(gate(x)) * shared(x)


MOE_FAMILIES: dict[str, MoEFamily] = {
    "mixtral": MoEFamily(
        "MixtralSparseMoeBlock", num_experts="num_local_experts", norm_topk_prob=True, jitter="router_jitter_noise"
    ),
    "qwen2_moe": MoEFamily(
        "Qwen2MoeSparseMoeBlock", shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"
    ),
    "qwen3_moe": MoEFamily("Qwen3MoeSparseMoeBlock"),
    "olmoe": MoEFamily("OlmoeSparseMoeBlock"),
}


@dataclass
class MoEBlock:
    path: str
    module: nn.Module
    fam: MoEFamily | None  # None: an hfpar MoELayer (upcycled) with all experts
    E: int = 0
    k: int = 0


def config_num_experts(config) -> int | None:
    """The routed-expert count a model config declares (its text config; nested sub-configs too), or None: what the
    recipes' preflight reads before any model is built (after loading, has_moe_blocks / apply_expert_parallel)."""
    text = text_config(config)
    values = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    for d in [values, *(v for v in values.values() if isinstance(v, dict))]:
        for f in _EXPERT_FIELDS:
            if isinstance(d.get(f), int) and not isinstance(d.get(f), bool) and d[f] > 1:
                return d[f]
    return None


def has_moe_blocks(model: nn.Module) -> bool:
    """Whether `model` holds MoE blocks: hfpar MoELayers, the MOE_FAMILIES block of its model_type, or experts
    modules of HF MoE blocks (hf_experts.find_hf_experts, convertible or not)."""
    fam = MOE_FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if any(isinstance(m, MoELayer) or (fam is not None and type(m).__name__ == fam.block) for m in model.modules()):
        return True
    found, problems = find_hf_experts(model)
    return bool(found or problems)


def moe_replaced_paths(model: nn.Module) -> list[str]:
    """Paths of the modules whose computation hfpar's MoE conversion takes over, by what the blocks hold (no probe, no
    weights read): hfpar MoELayers; in an MOE_FAMILIES block of the model type or a generic block (a child holding 3-D
    gate_up_proj / down_proj: find_moe_blocks' generic detection) every child but the shared expert(s) and their gate,
    which the converted layer calls as they are (apply.py); each experts module find_hf_experts finds (its block's own
    code still runs). A PEFT adapter inside one of them would be bypassed by the converted layer."""
    fam = MOE_FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    kept = {*_SHARED, *((fam.shared_expert, fam.shared_expert_gate) if fam is not None else ())}
    paths = set()
    for path, m in model.named_modules():
        if isinstance(m, MoELayer):
            paths.add(path)
        elif (fam is not None and type(m).__name__ == fam.block) or _stacked_child(m):
            paths.update(f"{path}.{n}" if path else n for n, _ in m.named_children() if n not in kept)
    paths.update(e.path for e in find_hf_experts(model)[0])
    return sorted(paths)


def inside(path: str, roots: list[str]) -> bool:
    """Whether module `path` is one of `roots` or inside one (moe_replaced_paths' roots: what a converted layer
    computes itself)."""
    return any(path == r or path.startswith(f"{r}.") for r in roots)


def _stacked_child(m: nn.Module) -> bool:
    return any(
        all(isinstance(c._parameters.get(p), torch.Tensor) and c._parameters[p].dim() == 3 for p in _STACKED)
        for c in m.children()
    )


_STACKED = ("gate_up_proj", "down_proj")
_SHARED = ("shared_expert", "shared_experts", "shared_expert_gate")  # _describe's names for them


def config_value(cfg, spec):
    return spec if isinstance(spec, bool) else getattr(cfg, spec)


def find_moe_blocks(model: nn.Module, probe) -> tuple[list[MoEBlock], list[str]]:
    """Every MoE block of `model` (hfpar MoELayers, the MOE_FAMILIES block of its model_type, else generic blocks)
    and the problems found. probe(block, fam, E, k) -> relative difference of hfpar's equivalent (generic only)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    fam = MOE_FAMILIES.get(model_type)
    blocks, problems = [], []
    for path, m in model.named_modules():
        if isinstance(m, MoELayer):
            blocks.append(MoEBlock(path, m, None, m.num_experts, m.top_k))
        elif fam is not None and type(m).__name__ == fam.block:
            blocks.append(MoEBlock(path, m, fam, int(getattr(cfg, fam.num_experts)), int(getattr(cfg, fam.top_k))))
    if not blocks and fam is None:
        blocks, problems = _generic_blocks(model, cfg, model_type, probe)
    if not blocks and not problems:
        problems.append(
            f"model_type {model_type!r} is not a supported MoE architecture (supported: "
            f"{', '.join(sorted(MOE_FAMILIES))}, or any block with 3-D experts gate_up_proj / "
            f"down_proj and an (E, H) router); a dense model must first be converted with "
            f"upcycle_to_moe(model, num_experts, top_k) (its SwiGLU MLPs: gate_proj / up_proj / down_proj)"
        )
    return blocks, problems


# ----------------------------------------------------------------------------- generic detection
def _state_names(m: nn.Module, keep: tuple[str, ...]) -> list[str]:
    return [n for n, _ in [*m.named_parameters(), *m.named_buffers()] if n not in keep]


def _describe(m: nn.Module, ex_name: str, ex: nn.Module, cfg) -> tuple[MoEFamily | None, int, int, list[str]]:
    """(family, E, k, what does not fit) of a module whose child `ex_name` holds 3-D experts."""
    gu, dn = ex.gate_up_proj, ex.down_proj
    E, missing = gu.shape[0], []
    routers = [
        (n, c)
        for n, c in m.named_children()
        if c is not ex
        and isinstance(getattr(c, "weight", None), torch.Tensor)
        and c.weight.dim() == 2
        and c.weight.shape[0] == E
    ]
    if not routers:
        return None, E, 0, [f"no router (a child with an ({E}, hidden) weight)"]
    r_name, router = routers[0]
    H = router.weight.shape[1]
    I = dn.shape[-1]
    if tuple(gu.shape) != (E, 2 * I, H) or tuple(dn.shape) != (E, H, I):
        missing.append(
            f"experts gate_up_proj {tuple(gu.shape)} / down_proj {tuple(dn.shape)} are not in the "
            f"(E, 2I, H) / (E, H, I) layout"
        )
    if extra := _state_names(ex, ("gate_up_proj", "down_proj")):
        missing.append(f"expert {type(ex).__name__} has {', '.join(extra)} (biases are not supported)")
    if own := [n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]:
        # LFM2-MoE's expert_bias: zero at init, where a probe could not tell; a checkpoint's moves the routing
        missing.append(f"the block holds {', '.join(own)} itself (bias-corrected routing is not supported)")
    if extra := _state_names(router, ("weight",)):
        missing.append(
            f"router {type(router).__name__} has {', '.join(extra)} (only softmax top-k routing without "
            f"bias or score correction is supported)"
        )
    shared = [n for n in ("shared_expert", "shared_experts") if isinstance(getattr(m, n, None), nn.Module)]
    gate = getattr(m, "shared_expert_gate", None)
    if gate is not None and not (isinstance(gate, nn.Linear) and gate.out_features == 1 and gate.bias is None):
        missing.append("shared_expert_gate is not a Linear(hidden, 1) without bias")
    if ex_name != "experts":
        missing.append(f"its experts are named {ex_name!r}, not 'experts'")
    known = {ex_name, r_name, *shared, "shared_expert_gate"}
    if other := [n for n, c in m.named_children() if n not in known and any(True for _ in c.parameters())]:
        missing.append(f"unknown submodules {', '.join(other)}")
    k = getattr(router, "top_k", None) or getattr(m, "top_k", None) or getattr(cfg, "num_experts_per_tok", None)
    if k is None:
        missing.append("no top_k (router.top_k, block.top_k or config.num_experts_per_tok)")
    norm = getattr(router, "norm_topk_prob", getattr(m, "norm_topk_prob", getattr(cfg, "norm_topk_prob", None)))
    fam = MoEFamily(
        type(m).__name__,
        norm_topk_prob=bool(norm) if norm is not None else True,
        router=r_name,
        experts=ex_name,
        shared_expert=shared[0] if shared else None,
        shared_expert_gate="shared_expert_gate" if gate is not None else None,
        jitter="router_jitter_noise" if getattr(m, "jitter_noise", 0) else None,
    )
    return fam, E, int(k or 0), missing


def _generic_blocks(model, cfg, model_type, probe) -> tuple[list[MoEBlock], list[str]]:
    blocks, problems, probed = [], [], {}
    for path, m in model.named_modules():
        ex = [
            (n, c)
            for n, c in m.named_children()
            if all(isinstance(c._parameters.get(p), torch.Tensor) and c._parameters[p].dim() == 3 for p in _STACKED)
        ]
        if not ex:
            continue
        where = f"model_type {model_type!r}: {path} ({type(m).__name__})"
        fam, E, k, missing = _describe(m, *ex[0], cfg)
        if not missing and fam.block not in probed:
            probed[fam.block] = _probe_norm(probe, m, fam, E, k, missing)
        if missing:
            problems.append(f"{where} is not an MoE block hfpar can convert: {'; '.join(missing)}")
            break  # one line: the other layers repeat it
        blocks.append(MoEBlock(path, m, probed[fam.block] or fam, E, k))
    return blocks, problems


def _probe_norm(probe, m, fam: MoEFamily, E: int, k: int, missing: list[str]) -> MoEFamily | None:
    """The family (renormalized top-k or not) whose hfpar block reproduces m's output; else appends to missing."""
    wide = getattr(m, fam.experts).gate_up_proj.dtype in (torch.float32, torch.float64)
    tried, tol = [], 1e-4 if wide else 5e-2
    for norm in (fam.norm_topk_prob, not fam.norm_topk_prob):
        cand = MoEFamily(**{**fam.__dict__, "norm_topk_prob": norm})
        try:
            rel = probe(m, cand, E, k)
        except Exception as exc:  # noqa: BLE001  (any failure of an unknown forward is a refusal, in one line)
            missing.append(f"probing its forward failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            return None
        if rel <= tol:
            return cand
        tried.append(f"{rel:.1e}")
    missing.append(
        f"its output differs from softmax top-{k} routing over SwiGLU experts (relative difference "
        f"{' / '.join(tried)} with / without renormalized top-k)"
    )
    return None
