"""HF output semantics of converted MoE layers: `output_router_logits` keeps working after apply_expert_parallel.

    record_router_logits(moe_layer, detach=False)     # done by apply_expert_parallel for every layer

transformers 5 collects `router_logits` with forward hooks its models install on their own router classes
(`_can_record_outputs`, active only inside a forward that asked for them); hfpar's TopKRouter is not one of
them, so without this the model returns no router logits and `load_balancing_loss_func` fails. This hook
appends the router's (N, E) logits (this process's tokens, fp32) to the same collector, so the model returns
`router_logits`, computes `aux_loss` with its own load_balancing_loss_func (its attention_mask handling) and adds
`router_aux_loss_coef * aux_loss` to `loss`, exactly as the HF model does. detach=True when hfpar injects its
own aux loss (apply_expert_parallel(aux_loss_coef=...)): the returned aux term is then a value only, so the
gradient is not counted twice. Backward recomputation (activation checkpointing) runs outside any collector.
"""

from __future__ import annotations

from torch import nn

try:  # transformers' collector of a forward's recorded outputs
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # other transformers versions: nothing to record into
    _active_collector = None

__all__ = ["record_router_logits"]


def record_router_logits(layer: nn.Module, detach: bool = False):
    """Hook `layer.gate` (a TopKRouter: returns weights, indices, logits) into HF's output collector."""

    def hook(module, args, output):
        collected = _active_collector.get() if _active_collector is not None else None
        if collected is not None and "router_logits" in collected:
            logits = output[2]
            collected["router_logits"].append(logits.detach() if detach else logits)

    return layer.gate.register_forward_hook(hook)
