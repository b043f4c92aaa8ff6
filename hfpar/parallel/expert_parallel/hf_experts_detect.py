"""Which modules of an HF model are MoE experts modules hf_experts.py can shard by expert, and why not the others.

    found, problems = find_hf_experts(model)     # [HFExperts(path, module, block, E)], one line per module refused
    is_hf_experts_sharded(module)                # after shard_hf_experts

What fits and how it is checked: hf_experts.py's docstring.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from .moe import GroupedExperts

# attributes of transformers' experts classes that hold the expert count (set to the local count while sharded)
_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "num_routed_experts", "total_experts")


@dataclass
class HFExperts:
    path: str  # the experts module's name in the model
    module: nn.Module  # transformers' experts module (e.g. DeepseekV3NaiveMoe / GptOssExperts)
    block: nn.Module  # its parent: the HF MoE block whose forward routes and calls it
    E: int  # experts with weights of their own (sharded over the EP ranks)
    zero: int = 0  # routed indices E .. E + zero - 1: experts without weights of their own (run where the token is)


def _count(m: nn.Module) -> int | None:
    """The expert count the module states (num_experts, ...), if any."""
    return next((v for a in _COUNT_ATTRS if isinstance(v := getattr(m, a, None), int) and v > 0), None)


def _expert_candidate(name: str, m: nn.Module) -> bool:
    """An experts module: named for experts, holding either 3-D tensors of its own (transformers' stacked experts)
    or, under a stated expert count E, experts stacked as 2-D row blocks (DBRX: w1 / v1 / w2 (E * F, H) in a child
    GLU module; every tensor's dim 0 a multiple of E)."""
    own = list(m.parameters(recurse=False))
    every = list(m.parameters())
    last = name.rpartition(".")[2].lower()
    E = _count(m)
    stacked = any(p.dim() == 3 for p in own) or (
        E is not None and E > 1 and bool(every) and all(p.dim() >= 2 and p.shape[0] % E == 0 for p in every)
    )
    return (
        stacked
        and not last.startswith("shared")
        and not isinstance(m, GroupedExperts)  # hfpar's own MoELayer experts
        and ("expert" in last or "Expert" in type(m).__name__ or hasattr(m, "_is_expert_parallel"))
    )


def expert_rows(p, E: int) -> int:
    """Rows of dim 0 per expert: 1 for (E, ...) tensors, F for DBRX's (E * F, H) row blocks."""
    return p.shape[0] // E


def _forward_names(m: nn.Module) -> list[str]:
    try:
        return [
            p.name
            for p in inspect.signature(m.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def _forward_args(m: nn.Module) -> int:
    return len(_forward_names(m))


def _problem(m: nn.Module) -> tuple[int, int, str | None]:
    """(E, zero, why): the experts with weights of their own, the routed experts without (zero-computation experts:
    LongCat-Flash's identity experts, routed to indices E .. E + zero - 1, whose rows only the tensors holding
    E + zero rows keep, unused), and why the module cannot be sharded (None: it can)."""
    own = dict(m.named_parameters(recurse=False))
    zero = 0
    if any(p.dim() == 3 for p in own.values()):  # transformers' stacked experts: dim 0 is the expert
        rows = sorted({p.shape[0] for p in own.values()})
        E = rows[0]
        if len(rows) == 2 and rows[1] == _count_total(m) and all(p.dim() == 3 for p in own.values()):
            zero = rows[1] - E  # every tensor holds the E experts; the longer ones rows for the others too
        elif len(rows) != 1:
            dims = ", ".join(f"{n} {p.shape[0]}" for n, p in own.items())
            return E, 0, f"its parameters do not share one expert dim 0 ({dims})"
        if sub := [n for n, c in m.named_children() if any(True for _ in c.parameters())]:
            return E, zero, f"it holds submodules with parameters ({', '.join(sub)}), not only expert-indexed tensors"
    else:  # row blocks under the stated count (DBRX): every tensor, own or a child's, E blocks of dim 0
        E = _count(m)
        own = dict(m.named_parameters())
    n_args = _forward_args(m)
    if n_args == 1 and any(p.dim() != 3 for p in own.values()):
        return (
            E,
            zero,
            (
                "its forward takes every token for every expert (E*N, H) and it has biases: an unselected "
                "(zeroed) row would not give a zero output, so rows cannot be left out"
            ),
        )
    if n_args == 2 or n_args == 0 or (zero and n_args == 1):
        return (
            E,
            zero,
            (
                f"its forward takes ({', '.join(_forward_names(m))}), neither (hidden_states, top_k_index, "
                f"top_k_weights) nor the dense (E*N, H) routed input"
            ),
        )
    if E < 2:
        return E, zero, f"it holds {E} expert"
    return E, zero, None


def _count_total(m: nn.Module) -> int | None:
    """The largest expert count the module states (routed experts with and without weights of their own)."""
    return max((v for a in _COUNT_ATTRS if isinstance(v := getattr(m, a, None), int) and v > 0), default=None)


def find_hf_experts(model: nn.Module) -> tuple[list[HFExperts], list[str]]:
    """The experts modules of HF MoE blocks in `model` and one line per module (class) that cannot be sharded."""
    found, problems, seen = [], [], set()
    for path, m in model.named_modules():
        st = getattr(m, "_hfpar_ep", None)
        if not path or not _expert_candidate(path, m) or (st is not None and st.count < st.E):  # sharded already
            continue
        E, zero, why = _problem(m)
        if why is None:
            found.append(HFExperts(path, m, model.get_submodule(path.rpartition(".")[0]), E, zero))
        elif type(m) not in seen:
            seen.add(type(m))
            problems.append(f"{path} ({type(m).__name__}) cannot be sharded by expert: {why}")
    return found, problems


def is_hf_experts_sharded(m: nn.Module) -> bool:
    """Whether m runs hfpar's forward (sharded over EP ranks, or at ep = 1 its CPU kernel)."""
    return getattr(m, "_hfpar_ep", None) is not None


def _plain_swiglu(m: nn.Module) -> bool:
    """transformers' default experts layout (use_experts_implementation's defaults): gate_up_proj (E, 2I, H) [gate;
    up], down_proj (E, H, I), the default gate act_fn(gate) * up, no bias, no post-expert norm."""
    own = dict(m.named_parameters(recurse=False))
    if set(own) != {"gate_up_proj", "down_proj"} or not callable(getattr(m, "act_fn", None)):
        return False
    gu, dn = own["gate_up_proj"], own["down_proj"]
    gate = getattr(type(m), "_apply_gate", None)
    flags = {
        "has_gate": True,
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    return (
        gu.dim() == dn.dim() == 3
        and gu.shape[0] == dn.shape[0]
        and gu.shape[1] == 2 * dn.shape[2]
        and gu.shape[2] == dn.shape[1]
        and all(getattr(m, k, None) is v for k, v in flags.items())
        and getattr(gate, "__name__", None) == "_default_apply_gate"
        and getattr(gate, "__module__", None) == "transformers.integrations.moe"
    )
