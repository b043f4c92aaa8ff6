"""Which HF MoE architecture an upcycled model is written as, decided by what the models compute, not by a table of
family names.

    target = export_target(config)     # an ExportTarget (Mixtral for a Llama, Qwen3-MoE for a Qwen3) or why not
    why_not = upcycle_problem(config)  # None: --upcycle_experts trains it and saves a from_pretrained checkpoint

upcycle_to_moe turns every dense SwiGLU MLP (gate_proj / up_proj / down_proj) into a MoELayer of copies of it. The
result must be saved as an HF MoE architecture whose decoder is the dense one's with MoE blocks in place of the MLPs,
and which routes as hfpar's router does (softmax, top-k, renormalized). The check, on a tiny float64 copy of the
run's own config (hfpar.parallel.tiny_copy: the same family and flags, its first 8 layers):
1. upcycled with 4 experts, top-2, the model still computes the dense function (logits to 1e-6: the router's
   softmax is fp32): the MLPs are the SwiGLU upcycle_to_moe rebuilds, with the config's activation;
2. the experts made different and the router non-trivial (seeded noise), each candidate of EXPORT_TARGETS in turn
   is built from the dense config's shared fields (export_config), loads the upcycled state dict with no key missing
   or left over, and must give the upcycled model's logits (1e-6): the first one that does is the target.
A dense config whose flags no candidate has (Llama with attention_bias: Mixtral has no attention bias) is refused
in one line before the model loads (hfpar.preflight), and at export.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig

from ..tiny_copy import build_float64, check_once
from .moe import MoELayer
from .upcycle import upcycle_to_moe


@dataclass(frozen=True)
class ExportTarget:
    """An HF MoE architecture an upcycled model may be written as: its model_type and how its config names the
    expert count and the experts' intermediate size; constants: fields set so every layer is sparse and the top-k
    weights renormalized (hfpar's router)."""

    model_type: str
    num_experts: str = "num_local_experts"
    intermediate: tuple[str, ...] = ("intermediate_size",)
    constants: dict = field(default_factory=dict)
    top_k: str = "num_experts_per_tok"


# the candidates, tried in this order; the check decides which (if any) reproduces a given dense model
EXPORT_TARGETS = (
    ExportTarget("mixtral"),
    ExportTarget(
        "qwen3_moe",
        "num_experts",
        ("moe_intermediate_size",),
        {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    ExportTarget("flex_olmo", "num_experts", constants={"norm_topk_prob": True}),
    ExportTarget("olmoe", "num_experts", constants={"norm_topk_prob": True}),
)
TOL = 1e-6  # relative; the router takes its softmax in fp32 (HF semantics): 1e-8 in a float64 model, a wrong MLP 1e-1
EXPERTS, TOP_K = 4, 2


def export_config(src, target: ExportTarget, num_experts: int, top_k: int, aux_loss_coef: float, intermediate: int):
    """The HF config of `target` for an upcycled model of dense config `src`: the fields the two configs share,
    the expert count, top-k, the aux-loss coefficient, the experts' intermediate size and the target's constants."""
    cls = type(AutoConfig.for_model(target.model_type))
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls().to_dict())
    names -= {"architectures", "transformers_version", "model_type", "auto_map"}
    kw = {k: v for k, v in src.to_dict().items() if k in names}
    kw.update(
        {
            target.num_experts: num_experts,
            target.top_k: top_k,
            "router_aux_loss_coef": aux_loss_coef,
            "output_router_logits": False,
            **{n: intermediate for n in target.intermediate},
            **target.constants,
        }
    )
    return AutoConfig.for_model(target.model_type, **kw)


def export_target(config) -> ExportTarget | str:
    """The first of EXPORT_TARGETS that computes what `config`'s upcycled model computes, else why none (a line)."""
    if why := check_once("upcycle", config, _dense_function_kept):
        return why
    for target in EXPORT_TARGETS:
        if check_once(f"upcycle-export-{target.model_type}", config, lambda m, t=target: _reproduces(m, t)) is None:
            return target
    names = ", ".join(t.model_type for t in EXPORT_TARGETS)
    return f"no HF MoE architecture reproduces its upcycled model (tried {names}; checked on a tiny copy)"


def upcycle_problem(config) -> str | None:
    """None where --upcycle_experts can train `config`'s model and save it as an HF MoE checkpoint, else why not."""
    target = export_target(config)
    return target if isinstance(target, str) else None


def _ids(model) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(1, min(vocab, 64), (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / (b.norm() or 1.0))


def _dense_function_kept(model) -> str | None:
    ids = _ids(model)
    want = _logits(model, ids)
    try:
        up = upcycle_to_moe(copy.deepcopy(model), EXPERTS, TOP_K, router_init_std=1.0)
    except ValueError as e:
        return str(e).removeprefix("upcycle_to_moe: ")
    if (d := _rel(_logits(up, ids), want)) > TOL:
        return f"its upcycled MLPs do not compute the dense MLPs (logits {d:.1e} apart): not the SwiGLU it rebuilds"
    return None


def _diverse(model) -> torch.nn.Module:
    """The upcycled tiny model with distinct experts and a router that matters (seeded noise)."""
    up = upcycle_to_moe(copy.deepcopy(model), EXPERTS, TOP_K, router_init_std=1.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in up.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.abs().mean())
    return up


def _reproduces(model, target: ExportTarget) -> str | None:
    up = _diverse(model)
    layer = next(m for m in up.modules() if isinstance(m, MoELayer))
    cfg = export_config(model.config, target, EXPERTS, TOP_K, 0.0, layer.experts.intermediate_size)
    shell = build_float64(cfg, model.config._attn_implementation)
    sd = up.state_dict()
    if other := set(shell.state_dict()) ^ set(sd):
        return f"{target.model_type}: other weights ({sorted(other)[:2]})"
    shell.load_state_dict(sd)
    ids = _ids(model)
    d = _rel(_logits(shell, ids), _logits(up, ids))
    return None if d <= TOL else f"{target.model_type}: logits {d:.1e} apart"
