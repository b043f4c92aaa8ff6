"""What the MoE layer tests share: a seeded MoELayer and the aux-loss gradient scale set for a block.

Used by tests/distributed/test_moe_layers.py and test_moe_ep.py:
    layer = make_moe(E=4, k=2, aux=0.1)          # TopKRouter + GroupedExperts, weights drawn from `seed`
    with grad_scale(0.0): ...                    # no aux-loss gradient injected inside the block
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hfpar.parallel.expert_parallel.moe import (
    AuxLossBackprop,
    GroupedExperts,
    MoELayer,
    TopKRouter,
    set_aux_loss_grad_scale,
)

TOL = dict(rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def grad_scale(s):
    prev = AuxLossBackprop.grad_scale
    set_aux_loss_grad_scale(s)
    try:
        yield
    finally:
        set_aux_loss_grad_scale(prev)


def make_moe(
    E=6,
    H=16,
    I=12,
    k=2,
    *,
    seed=0,
    shared=False,
    group=None,
    ep_group=None,
    capacity_factor=None,
    aux=0.0,
    z=0.0,
    norm=True,
    dtype=torch.float32,
):
    torch.manual_seed(seed)
    router = TopKRouter(H, E, k, norm_topk_prob=norm, aux_loss_coef=aux, z_loss_coef=z, group=group)
    experts = GroupedExperts(E, H, I)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    kw = {}
    if shared:
        kw = dict(
            shared_expert=nn.Sequential(nn.Linear(H, 8, bias=False), nn.SiLU(), nn.Linear(8, H, bias=False)),
            shared_expert_gate=nn.Linear(H, 1, bias=False),
        )
    return MoELayer(router, experts, ep_group=ep_group, capacity_factor=capacity_factor, **kw).to(dtype)
