"""Top-k token router for mixture-of-experts layers, with load-balancing and z losses.

    router = TopKRouter(hidden_size=64, num_experts=8, top_k=2, aux_loss_coef=0.02, group=dp_group)
    weights, experts, logits = router(x)          # x (N, H) -> (N, k) fp32, (N, k) int64, (N, E) fp32
    router.last_aux_loss, router.last_z_loss, router.last_load   # detached, for logging

Routing (Mixtral / Qwen2-MoE): logits = x @ W^T in the common dtype of x and W (HF's routers: bf16 weights and
activations give bf16 logits; under autocast, autocast's dtype; fp32 when either is fp32), then in fp32:
probs = softmax(logits), top-k of probs,
optionally renormalized so the k weights sum to 1 (`norm_topk_prob`). Optional multiplicative
jitter x * U(1-eps, 1+eps) on the *router input only*, in training (Switch Transformer; Mixtral
jitters the whole block input instead).

Losses, computed over the GLOBAL token set of `group` (the ranks that see different tokens: pass
the data-parallel group; None = this process's tokens only):
    aux = E * sum_e f_e * P_e        f_e = (#tokens with e among their top-k) / N   (sum_e f_e = k)
                                     P_e = mean over tokens of softmax prob of e
    z   = mean over tokens of logsumexp(logits)^2
This is exactly transformers' `load_balancing_loss_func` for one layer (perfect balance gives
aux = k), so HF's `router_aux_loss_coef` keeps its meaning. Counts, prob sums, z sums and the token
count are all-reduced in one fp64 buffer; the other ranks' parts enter as constants, so each rank's
backward holds the exact partial derivative of the global loss w.r.t. its own tokens and the SUM of
the ranks' router gradients is the gradient of the global loss. Tokens masked out by `token_mask`
(padding) are left out of every statistic.

How the losses reach the gradient: the model never returns them. `AuxLossBackprop` returns the
routing weights unchanged in forward and, in backward, feeds d(loss)/d(loss) = `grad_scale` into
coef_aux * aux + coef_z * z, so each MoE layer adds grad_scale * d(coef * aux)/d(params).
    grad_scale = 1 (default): as if `coef * aux` were added to a loss backpropagated as is on one
        process, with no gradient accumulation.
    hfpar's trainer: each rank back-propagates local_sum * dp * accum / N_global, the backend
        averages over dp and Accelerate divides by accum, i.e. the main objective is the global
        token mean. For objective = main + coef * mean over micro-steps of (global) aux, set
        `set_aux_loss_grad_scale(dp / accum)`: the injected gradient bypasses the loss scaling done by
        Accelerate but not the dp average; under fp16 the backend sets `set_aux_loss_loss_scale(scale)`
        each micro-step so the injected gradient is scaled (and later unscaled) like the main loss's.
Every rank of `group` must run every router forward (the statistics are all-reduced there).

Run the unit tests: python -m pytest tests/distributed/test_moe_layers.py -q
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_reduce, group_size

__all__ = [
    "TopKRouter",
    "AuxLossBackprop",
    "set_aux_loss_grad_scale",
    "set_aux_loss_loss_scale",
    "moe_token_mask",
    "current_token_mask",
]


class AuxLossBackprop(torch.autograd.Function):
    """Identity on `x` forward; backward also sends `grad_scale` into `loss` (Megatron's MoEAuxLossAutoScaler)."""

    grad_scale: float = 1.0
    loss_scale: float = 1.0  # fp16: the GradScaler's current scale (the backend sets it each micro-step)

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, AuxLossBackprop.grad_scale * AuxLossBackprop.loss_scale)


def set_aux_loss_grad_scale(scale: float) -> None:
    """Scale of the injected aux / z loss gradient for every router (see the module docstring)."""
    AuxLossBackprop.grad_scale = float(scale)


def set_aux_loss_loss_scale(scale: float) -> None:
    """The fp16 loss scale the main loss is multiplied by in this backward (1 without fp16)."""
    AuxLossBackprop.loss_scale = float(scale)


# ----------------------------------------------------------------------------- padding mask
# HF decoder layers call `mlp(hidden_states)` with no mask, so the trainer can publish the real-token
# mask of the current batch here; routers then leave padding out of the aux / z / capacity statistics.
_TOKEN_MASK: list[torch.Tensor | None] = [None]


@contextlib.contextmanager
def moe_token_mask(mask: torch.Tensor | None):
    """`with moe_token_mask(attention_mask): model(...)`: mask (B, T), nonzero = real token."""
    prev, _TOKEN_MASK[0] = _TOKEN_MASK[0], mask
    try:
        yield
    finally:
        _TOKEN_MASK[0] = prev


def current_token_mask() -> torch.Tensor | None:
    return _TOKEN_MASK[0]


# ----------------------------------------------------------------------------- router
class TopKRouter(nn.Module):
    """Linear gate (no bias; fp32 softmax) -> top-k; `weight` is (E, H) like HF's `mlp.gate.weight`."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        jitter_eps: float = 0.0,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        group=None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.norm_topk_prob, self.jitter_eps = norm_topk_prob, jitter_eps
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.group = group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        # Detached values of the last forward, for logging (global over `group`).
        self.last_aux_loss = torch.zeros(())
        self.last_z_loss = torch.zeros(())
        self.last_load = torch.zeros(num_experts)  # (E,) tokens routed to each expert

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, experts={self.num_experts}, top_k={self.top_k}, "
            f"norm_topk_prob={self.norm_topk_prob}, aux_coef={self.aux_loss_coef}, z_coef={self.z_loss_coef}"
        )

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None):
        """x (N, H), token_mask (N,) nonzero = real token -> weights (N, k) fp32, indices (N, k), logits (N, E)."""
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        dtype = torch.promote_types(x.dtype, self.weight.dtype)  # bf16 x bf16: bf16, as HF's routers
        logits = F.linear(x.to(dtype), self.weight.to(dtype)).float()  # (N, E)
        probs = logits.softmax(dim=-1)  # (N, E)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)  # (N, k), (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        losses = self._losses(logits, probs, indices, token_mask)
        if losses is not None and torch.is_grad_enabled() and losses.requires_grad:
            weights = AuxLossBackprop.apply(weights, losses)
        return weights, indices, logits

    def _losses(self, logits, probs, indices, token_mask) -> torch.Tensor | None:
        """Global aux / z losses; sets the last_* attributes; returns coef_aux*aux + coef_z*z or None."""
        N, E = probs.shape
        m = torch.ones(N, device=probs.device) if token_mask is None else token_mask.reshape(N).to(probs.device).float()
        counts = torch.zeros(E, device=probs.device).index_add_(
            0, indices.reshape(-1), m.repeat_interleave(self.top_k)
        )  # (E,) real tokens per expert
        prob_sum = (probs * m[:, None]).sum(0)  # (E,) differentiable
        z_sum = (torch.logsumexp(logits, dim=-1).square() * m).sum()  # () differentiable
        local = torch.cat([counts, prob_sum.detach(), m.sum()[None], z_sum.detach()[None]]).double()
        glob = all_reduce(local, self.group) if self.group is not None and group_size(self.group) > 1 else local
        g_counts, g_prob_sum = glob[:E].float(), glob[E : 2 * E].float()
        n = glob[2 * E].float().clamp_min(1.0)
        # Global value, local gradient: the other ranks' sums enter as constants.
        prob_sum = prob_sum + (g_prob_sum - prob_sum.detach())
        z_sum = z_sum + (glob[2 * E + 1].float() - z_sum.detach())
        aux = E * torch.sum((g_counts / n) * (prob_sum / n))
        z = z_sum / n
        self.last_aux_loss, self.last_z_loss, self.last_load = aux.detach(), z.detach(), g_counts.detach()
        if self.aux_loss_coef == 0 and self.z_loss_coef == 0:
            return None
        return self.aux_loss_coef * aux + self.z_loss_coef * z
