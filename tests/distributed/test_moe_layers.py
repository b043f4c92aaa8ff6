"""TopKRouter, GroupedExperts and MoELayer (hfpar.parallel.expert_parallel.moe / router), forward and backward.

Single process: the router vs naive formulas and transformers' load_balancing_loss_func, the aux-loss
gradient injection vs adding coef * aux to the loss, GroupedExperts vs a per-token loop, MoELayer vs
transformers' Mixtral and Qwen2-MoE sparse blocks (same state dict), capacity dropping vs a naive rule.
The expert-parallel layer over gloo ranks: tests/distributed/test_moe_ep.py.

    python -m pytest tests/distributed/test_moe_layers.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hfpar.parallel.expert_parallel.kernels import grouped_linear
from hfpar.parallel.expert_parallel.moe import (
    GroupedExperts,
    MoELayer,
    TopKRouter,
    moe_token_mask,
)
from tests.helpers.moe_layers import TOL, grad_scale, make_moe


def naive_route(x, W, k, renorm):
    logits = x.float() @ W.float().T  # (N, E)
    probs = logits.softmax(-1)
    w, i = probs.sort(dim=-1, descending=True)
    w, i = w[:, :k], i[:, :k]
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, i, logits, probs


def naive_losses(x, W, k, mask=None):
    """E * sum_e (count_e / N) * mean_prob_e and mean(logsumexp^2) over real tokens (differentiable in W)."""
    _, i, logits, probs = naive_route(x, W, k, False)
    m = torch.ones(x.shape[0]) if mask is None else mask.float()
    E = W.shape[0]
    counts = torch.stack([((i == e).any(-1).float() * m).sum() for e in range(E)])
    n = m.sum()
    aux = E * ((counts / n) * (probs * m[:, None]).sum(0) / n).sum()
    z = (torch.logsumexp(logits, -1) ** 2 * m).sum() / n
    return aux, z


def naive_experts(x, expert_of_row, gate_up, down):
    """Per-token loop: row t goes through expert expert_of_row[t]."""
    I = down.shape[-1]
    rows = []
    for t in range(x.shape[0]):
        e = int(expert_of_row[t])
        h = gate_up[e] @ x[t]  # (2I,)
        rows.append(down[e] @ (F.silu(h[:I]) * h[I:]))
    return torch.stack(rows) if rows else x.new_zeros(0, down.shape[1])


# ----------------------------------------------------------------------------- router
@pytest.mark.parametrize("renorm", [True, False])
def test_router_topk_vs_naive(renorm):
    torch.manual_seed(0)
    r = TopKRouter(16, 8, 3, norm_topk_prob=renorm, aux_loss_coef=0.0)
    x = torch.randn(40, 16, dtype=torch.float64)
    w, i, logits = r(x)
    w0, i0, l0, _ = naive_route(x, r.weight, 3, renorm)
    assert w.dtype == torch.float32 and logits.dtype == torch.float32
    assert torch.equal(i, i0)
    torch.testing.assert_close(w, w0, **TOL)
    torch.testing.assert_close(logits, l0, **TOL)
    assert torch.allclose(w.sum(-1), torch.ones(40)) == renorm


def test_router_losses_vs_naive_and_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(1)
    r = TopKRouter(16, 8, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(2, 20, 16)
    mask = torch.rand(2, 20) > 0.3
    for m in (None, mask):
        _, _, logits = r(x.view(-1, 16), None if m is None else m.view(-1))
        aux, z = naive_losses(x.view(-1, 16), r.weight, 2, None if m is None else m.view(-1))
        torch.testing.assert_close(r.last_aux_loss, aux.detach(), **TOL)
        torch.testing.assert_close(r.last_z_loss, z.detach(), **TOL)
        hf = load_balancing_loss_func((logits.detach(),), 8, 2, None if m is None else m.long())
        torch.testing.assert_close(r.last_aux_loss, hf, **TOL)  # same normalization as HF
    counts = torch.bincount(torch.topk(logits, 2).indices[mask.view(-1)].view(-1), minlength=8).float()
    assert torch.equal(r.last_load, counts)
    with pytest.raises(ValueError, match="top_k=9"):
        TopKRouter(16, 8, 9)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_aux_loss_gradient_injection(scale):
    """Injected gradient == grad of main + scale * (coef_aux * aux + coef_z * z) added explicitly."""
    torch.manual_seed(2)
    r = TopKRouter(16, 6, 2, aux_loss_coef=0.3, z_loss_coef=0.05)
    nn.init.normal_(r.weight, std=0.5)
    x, c = torch.randn(30, 16), torch.randn(30, 2)
    with grad_scale(scale):
        w, _, _ = r(x)
        (w * c).sum().backward()
    injected, r.weight.grad = r.weight.grad.clone(), None
    with grad_scale(0.0):  # no injection; add the losses by hand
        w, _, _ = r(x)
        aux, z = naive_losses(x, r.weight, 2)
        ((w * c).sum() + scale * (0.3 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(injected, r.weight.grad, **TOL)
    r.weight.grad = None
    with grad_scale(0.0):
        w, _, _ = r(x)
        (w * c).sum().backward()
    assert (injected - r.weight.grad).abs().max() > 1e-2  # the aux term really contributed


# ----------------------------------------------------------------------------- experts
@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "grouped_linear"])
def test_grouped_experts_vs_naive(backend):
    if backend == "grouped_mm" and not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        pytest.skip("no grouped_mm in this torch")
    torch.manual_seed(3)
    ex = GroupedExperts(5, 16, 8)
    ex.backend = backend  # instance override; "grouped_mm" runs on CPU fp32 in torch >= 2.10
    counts = torch.tensor([3, 0, 5, 0, 2])  # experts 1 and 3 get no token
    x = torch.randn(10, 16, requires_grad=True)
    g = torch.randn(10, 16)
    y = ex(x, counts)
    (y * g).sum().backward()
    expert_of_row = torch.repeat_interleave(torch.arange(5), counts)
    x2 = x.detach().clone().requires_grad_()
    gu, dn = ex.gate_up_proj.detach().clone().requires_grad_(), ex.down_proj.detach().clone().requires_grad_()
    y2 = naive_experts(x2, expert_of_row, gu, dn)
    (y2 * g).sum().backward()
    torch.testing.assert_close(y, y2, **TOL)
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    torch.testing.assert_close(ex.gate_up_proj.grad, gu.grad, **TOL)
    torch.testing.assert_close(ex.down_proj.grad, dn.grad, **TOL)
    assert ex.gate_up_proj.grad[[1, 3]].abs().sum() == 0
    # no tokens at all
    y0 = ex(torch.zeros(0, 16), torch.zeros(5, dtype=torch.long))
    assert y0.shape == (0, 16)


def test_grouped_linear_reuses_the_weight_grad_buffer_only_when_nothing_holds_it():
    """kernels.grouped_linear's backward writes the weight gradient into a buffer its cache keeps: reused once .grad
    let go of it (zero_grad(set_to_none=True)), never while anything holds it (accumulation, a kept reference)."""
    torch.manual_seed(0)
    w, x, counts, cache = torch.randn(3, 4, 5, requires_grad=True), torch.randn(6, 5), [2, 0, 4], {}

    def step():
        grouped_linear(x, w, counts, cache).square().sum().backward()

    step()
    g1, first = w.grad.clone(), w.grad.data_ptr()
    ref = w.detach().clone().requires_grad_()
    torch.cat([x[:2] @ ref[0].T, x[2:] @ ref[2].T]).square().sum().backward()
    torch.testing.assert_close(g1, ref.grad, **TOL)
    assert g1[1].abs().sum() == 0  # the unhit expert
    step()  # accumulation: .grad holds the buffer
    torch.testing.assert_close(w.grad, 2 * g1, **TOL)
    assert w.grad.data_ptr() == first
    w.grad = None
    step()  # free again: reused, overwritten
    assert w.grad.data_ptr() == first
    torch.testing.assert_close(w.grad, g1, **TOL)
    held = w.grad
    w.grad = None
    step()  # still held: fresh memory
    assert w.grad.data_ptr() != first and held.data_ptr() == first
    torch.testing.assert_close(held, g1, **TOL)
    torch.testing.assert_close(w.grad, g1, **TOL)


def test_grouped_linear_traced_equals_eager():
    """Under torch.compile (its traced path: no writes into views, which AOT autograd refused in a DDP-split
    evaluation graph) the same GEMMs: forward bit-identical, with and without grad, and the same gradients."""
    torch.manual_seed(0)
    w, x, counts = torch.randn(3, 4, 5, requires_grad=True), torch.randn(6, 5), [2, 0, 4]
    traced = torch.compile(lambda x, w: grouped_linear(x, w, counts), backend="aot_eager", dynamic=True)
    with torch.no_grad():
        assert torch.equal(traced(x, w), grouped_linear(x, w, counts))
    traced(x, w).square().sum().backward()
    g_traced, w.grad = w.grad, None
    grouped_linear(x, w, counts).square().sum().backward()
    torch.testing.assert_close(g_traced, w.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------- vs transformers
def _compare_with_hf(hf_block, ours, H, seed):
    ours.load_state_dict(hf_block.state_dict())  # same names and layouts, strict
    torch.manual_seed(seed)
    x = torch.randn(3, 7, H)
    g = torch.randn(3, 7, H)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = hf_block(x1)
    y2 = ours(x2)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    torch.testing.assert_close(y2, y1, **TOL)
    torch.testing.assert_close(x2.grad, x1.grad, **TOL)
    theirs = dict(hf_block.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, **TOL, msg=name)


def test_moe_layer_matches_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    assert hf.experts.gate_up_proj.shape == (4, 48, 16) and hf.experts.down_proj.shape == (4, 16, 24)
    ours = MoELayer(TopKRouter(16, 4, 2, norm_topk_prob=True, aux_loss_coef=0.0), GroupedExperts(4, 16, 24))
    _compare_with_hf(hf, ours, 16, seed=1)


def test_moe_layer_matches_qwen2_moe_with_shared_expert():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=16,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    hf = Qwen2MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = MoELayer(
        TopKRouter(16, 6, 2, norm_topk_prob=False, aux_loss_coef=0.0),
        GroupedExperts(6, 16, 12),
        shared_expert=Qwen2MoeMLP(cfg, intermediate_size=20),
        shared_expert_gate=nn.Linear(16, 1, bias=False),
    )
    _compare_with_hf(hf, ours, 16, seed=2)


# ----------------------------------------------------------------------------- capacity, mask
def naive_capacity_moe(layer: MoELayer, x, mask=None):
    """Token-order capacity: expert e keeps the first C real copies (C from real tokens), dropped ones give 0."""
    x = x.reshape(-1, x.shape[-1])
    N, E, k = x.shape[0], layer.num_experts, layer.top_k
    m = torch.ones(N, dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
    w, idx, _ = layer.gate(x, m)
    C = math.ceil(layer.capacity_factor * k * int(m.sum()) / E)
    used = [0] * E
    out = torch.zeros_like(x)
    for t in range(N):
        for s in range(k):
            e = int(idx[t, s])
            if not m[t] or used[e] >= C:
                continue
            used[e] += 1
            y = naive_experts(x[t : t + 1], [e], layer.experts.gate_up_proj, layer.experts.down_proj)[0]
            out[t] = out[t] + w[t, s] * y
    return out


def test_capacity_and_token_mask_single_process():
    torch.manual_seed(4)
    layer = make_moe(E=4, k=2, capacity_factor=0.6)
    x = torch.randn(2, 9, 16)
    mask = torch.rand(2, 9) > 0.25
    for m in (None, mask):
        with moe_token_mask(m):
            y = layer(x)
        y0 = naive_capacity_moe(layer, x, m)
        torch.testing.assert_close(y.view(-1, 16), y0, **TOL)
        assert layer.last_dropped > 0
    # dropless: the mask only changes the statistics, not the outputs
    dropless = make_moe(E=4, k=2, aux=0.1)
    y1 = dropless(x)
    aux_all = dropless.gate.last_aux_loss
    y2 = dropless(x, token_mask=mask)
    torch.testing.assert_close(y1, y2)
    aux_masked, _ = naive_losses(x.view(-1, 16), dropless.gate.weight, 2, mask.view(-1))
    torch.testing.assert_close(dropless.gate.last_aux_loss, aux_masked.detach(), **TOL)
    assert not torch.allclose(aux_all, aux_masked)
    with pytest.raises(ValueError, match="token mask"):
        dropless(x, token_mask=mask[:, :5])


def test_validation_messages():
    r = TopKRouter(16, 6, 2)
    with pytest.raises(ValueError, match="experts holds 5 experts"):
        MoELayer(r, GroupedExperts(5, 16, 8))
    with pytest.raises(ValueError, match="hidden_size=8"):
        MoELayer(r, GroupedExperts(6, 8, 8))
