"""LoRA adapters on tensor-parallel layers: PEFT's LoRA, each adapter split like the layer it adapts.

    from peft import LoraConfig
    from hfpar.loading.lora_targets import resolve_lora_config
    config = LoraConfig(target_modules="all-linear", r=16, lora_dropout=0.0)
    config = resolve_lora_config(config, model)             # PEFT's own targets, on the unsplit model
    apply_tensor_parallel(model, tp_group)                  # first: TP plans and checks the plain HF model
    model = get_tp_peft_model(model, config)                # PeftModel; adapters on the TP layers split

PEFT (0.21) has LoRA layers for Megatron's parallel layers only (they build Megatron's own parallel Linears),
so hfpar registers its own through PEFT's custom-module API (`LoraConfig._register_custom_module`):

    column-parallel W (out/tp, in):  A (r, in) whole,  B (out/tp, r) this rank's rows (packed parts as W's)
        y_local = W_local x + s B_local A x                     A's grad is partial: summed over TP
    row-parallel    W (out, in/tp):  A (r, in/tp) this rank's columns,  B (out, r) whole
        y = reduce( W_local x_local + s B A_local x_local )     the adapter's partial sums join the layer's
                                                                before its all-reduce / reduce-scatter;
                                                                B's grad is partial: summed over TP
Each adapter is drawn whole exactly as PEFT draws it on the unsplit layer (same RNG stream, same order), then
split, so a TP run starts from the one-process run's adapters. The split adapters carry ShardSpecs, so the grad
norm, the optimizer and the export (full_state_dict: the adapter gathered under PEFT's names) need nothing else.
A LoRA layer PEFT builds itself on a whole Linear inside a TP region (a replicated projection acting on this
rank's heads) gets its base weight's partial-grad group. Every adapter with a partial grad gets the in-backward sum
apply_tensor_parallel gives the model's own, so a plain loop's backward leaves complete grads.
MoE blocks stay whole on every TP rank (expert parallelism splits them): adapters there (a router, the experts'
weights through PEFT's ParamWrapper, a shared expert) are PEFT's own, on replicated modules whose grads are complete on
every rank, as long as the block is the HF model's own; inside one of hfpar's MoE layers (which compute the routers and
experts from their weights) an adapter would get no gradient, and is refused.
Refused in one line: DoRA and other LoRA variants, lora_bias, merging on the split layers (merge the export), an
unresolved "all-linear" (PEFT would pick the whole Linear layers left after TP only), adapters inside hfpar's MoE
layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import group_rank
from ..expert_parallel.families import inside
from ..expert_parallel.moe import MoELayer
from ..sharding import ShardSpec, partial_grad_hooks, set_shard_spec, shard_spec, shard_tensor
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["TPLoraRefusal", "get_tp_peft_model"]


def _lora_linear():
    # peft is imported on use: an optional extra that costs ~2.8 s per process (hfpar.loading.lora)
    from peft.tuners.lora.layer import Linear  # noqa: PLC0415

    return Linear


class TPLoraRefusal(ValueError):
    """A one-line refusal of LoRA on a tensor-parallel model (DoRA, lora_bias, adapters in hfpar's MoE layers, an
    unresolved all-linear): raised as it is."""


def _refuse(layer, what: str) -> None:
    raise TPLoraRefusal(
        f"LoRA with --tp_size: {what} is not supported on a tensor-parallel layer "
        f"({type(layer.base_layer).__name__}); use plain LoRA (lora_bias=False, no DoRA) or tp_size 1"
    )


def _tp_lora_class(base: type):
    """PEFT's lora.Linear for hfpar's column / row parallel layers (built lazily: peft is optional)."""
    column = issubclass(base, ColumnParallelLinear)

    class TPLoraLinear(_lora_linear()):
        def _get_in_out_features(self, module):  # the unsplit sizes: A and B drawn as on the whole layer
            return module.in_features, module.out_features

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            if config.use_dora or getattr(config, "lora_bias", False):
                _refuse(self, "DoRA" if config.use_dora else "lora_bias")
            if type(self.base_layer).__name__.endswith("Conv1D"):  # GPT-2: as PEFT's dispatch sets it for Conv1D
                self.fan_in_fan_out = config.fan_in_fan_out = True
            super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
            if adapter_name in self.lora_variant:
                _refuse(self, f"the LoRA variant {type(self.lora_variant[adapter_name]).__name__}")
            base_layer = self.base_layer
            group, tp, rank = base_layer.group, base_layer.tp, group_rank(base_layer.group)
            a, b = self.lora_A[adapter_name], self.lora_B[adapter_name]
            if column:  # B by output rows, in W's packed parts; A whole, its grad partial
                _split(b, 0, rank, tp, group, base_layer.packed_splits)
                _partial(a, group)
            else:  # A by input columns; B whole, its grad partial
                _split(a, 1, rank, tp, group, None)
                _partial(b, group)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            base_layer = self.base_layer
            if self.disable_adapters or self.merged or not self.active_adapters:
                return base_layer(x)
            x = base_layer.enter_region(x)
            y = base_layer._linear(x)
            for name in self.active_adapters:
                if name in self.lora_A:
                    a, b = self.lora_A[name], self.lora_B[name]
                    h = self._cast_input_dtype(x, a.weight.dtype)
                    y = y + (b(a(self.lora_dropout[name](h))) * self.scaling[name]).to(y.dtype)
            return base_layer.exit_region(y)

        def merge(self, *args, **kwargs) -> None:
            _no_merge()

        def get_delta_weight(self, adapter) -> torch.Tensor:
            _no_merge()

    TPLoraLinear.__name__ = TPLoraLinear.__qualname__ = f"Lora{base.__name__}"
    return TPLoraLinear


def _no_merge():
    raise NotImplementedError(
        "LoRA on a tensor-parallel layer: merge the gathered export (--merge_adapter, or merge_and_unload on the "
        "exported adapter), not the split layer"
    )


def _split(linear: nn.Linear, dim: int, rank: int, tp: int, group, packed) -> None:
    w = linear.weight
    local = shard_tensor(w.detach(), dim, rank, tp, packed).contiguous()
    linear.weight = set_shard_spec(
        nn.Parameter(local, requires_grad=w.requires_grad),
        ShardSpec(kind="tp", group=group, dim=dim, size=tp, packed_splits=None if packed is None else list(packed)),
    )
    if dim == 0:
        linear.out_features = local.shape[0]
    else:
        linear.in_features = local.shape[1]


def _partial(linear: nn.Linear, group) -> None:
    for p in linear.parameters():
        set_shard_spec(p, ShardSpec(kind="replicated", partial_grad_group=group))
    partial_grad_hooks(linear.parameters())  # summed in backward, as apply_tensor_parallel's own


_TP_LORA_MODULES: dict[type, type] = {}


def get_tp_peft_model(model: nn.Module, config, targets=None):
    """PEFT's get_peft_model on a tensor-parallel `model`, with hfpar's split adapters on its parallel layers.
    `config`: a LoraConfig resolved on the model BEFORE tensor parallelism (hfpar.loading.lora_targets.
    resolve_lora_config: hfpar's parallel layers are no nn.Linear, so PEFT cannot pick "all-linear" after), as a
    one-process run records it. Raises TPLoraRefusal (DoRA, lora_bias, adapters in hfpar's MoE layers, an unresolved
    "all-linear") or PEFT's ValueError."""
    from peft import get_peft_model  # noqa: PLC0415 (optional extra)

    if targets is not None:  # the earlier API: a list of module names misses PEFT's expert-weight targets
        raise TPLoraRefusal(
            "get_tp_peft_model(model, config, targets): pass the config resolved on the unsplit model instead "
            "(hfpar.loading.lora_targets.resolve_lora_config(config, model) before apply_tensor_parallel): on a MoE "
            "model PEFT also targets the experts' weights (target_parameters), which a list of module names misses"
        )
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        raise TPLoraRefusal(
            "LoRA with tensor parallelism: target_modules 'all-linear' must be resolved on the model before "
            "apply_tensor_parallel (hfpar.loading.lora_targets.resolve_lora_config(config, model)); after it PEFT "
            "would find only the Linear layers TP left whole"
        )
    if not _TP_LORA_MODULES:
        _TP_LORA_MODULES.update({c: _tp_lora_class(c) for c in (ColumnParallelLinear, RowParallelLinear)})
    config._register_custom_module(_TP_LORA_MODULES)
    model = get_peft_model(model, config)
    if bypassed := _in_moe_layers(model):  # hfpar's MoE layers read routers and experts from their weights
        raise TPLoraRefusal(  # (measured: such adapters got no gradient)
            f"LoRA with tensor parallelism: an adapter sits inside hfpar's MoE layer ({bypassed[0]}), which computes "
            "its routers and experts from their weights and would bypass it; name --lora_target_modules outside the "
            "MoE blocks' routers and experts (e.g. q_proj,k_proj,v_proj,o_proj), or keep the HF blocks (no "
            "apply_expert_parallel before LoRA)"
        )
    _mark_region_adapters(model)
    return model


def _in_moe_layers(model: nn.Module) -> list[str]:
    """Adapters inside hfpar's MoE layers, but for their shared expert(s) and its gate (called as the HF modules they
    are: adapters there train)."""
    layers = [(p, m) for p, m in model.named_modules() if isinstance(m, MoELayer)]
    kept = [f"{p}.{n}" for p, m in layers for n in (m.shared_name, "shared_expert_gate")]
    roots = [p for p, _ in layers]
    return [p for p, m in model.named_modules() if hasattr(m, "lora_A") and inside(p, roots) and not inside(p, kept)]


def _mark_region_adapters(model: nn.Module) -> int:
    """Adapters PEFT put on a whole (replicated) layer whose weight has a partial grad (it acts on this rank's heads
    or tokens, inside a TP region or under SP) get the same partial-grad group and its in-backward sum."""
    n = 0
    for m in model.modules():
        base, lora_a = getattr(m, "base_layer", None), getattr(m, "lora_A", None)
        if base is None or lora_a is None or isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            continue
        weight = getattr(base, "weight", None)
        spec = shard_spec(weight) if isinstance(weight, nn.Parameter) else None
        if spec is None or spec.partial_grad_group is None:
            continue
        for mod in (*m.lora_A.values(), *m.lora_B.values()):
            _partial(mod, spec.partial_grad_group)
            n += 1
    return n
