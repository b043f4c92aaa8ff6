"""The expert-parallel MoELayer (gloo, 2 and 4 ranks, one spawn each): every rank has DIFFERENT tokens; the EP layer
must match a full-expert layer (outputs, input grads), its gathered expert grads and summed router grads must match a
single-process layer run on all ranks' tokens, and so must the aux / z losses; with a capacity factor the EP result
equals the ep=1 result on the global token set.

    python -m pytest -q tests/distributed/test_moe_ep.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hfpar.parallel.comm import all_gather, all_reduce, comm_stats
from hfpar.parallel.expert_parallel.moe import (
    GroupedExperts,
    MoELayer,
    TopKRouter,
)
from hfpar.parallel.sharding import shard_spec
from tests.helpers.dist import run_distributed
from tests.helpers.moe_layers import TOL, grad_scale, make_moe


def _full_tokens(world, H, seed):
    """Rank r has (2, 3 + r, H) tokens: different tokens and different counts on each rank."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 3 + r, H, generator=g) for r in range(world)]
    gs = [torch.randn(2, 3 + r, H, generator=g) for r in range(world)]
    return xs, gs


def _grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def _ep_checks(rank, world):
    group = dist.group.WORLD
    E, H = 8, 16
    # ---- validation before any collective
    with pytest.raises(
        ValueError,
        match=r"num_experts=6 is not divisible by the expert-parallel size ep=4"
        if world == 4
        else r"num_experts=3 is not divisible .* ep=2",
    ):
        MoELayer(TopKRouter(H, 6 if world == 4 else 3, 2), GroupedExperts(6 if world == 4 else 3, H, 8), ep_group=group)
    with pytest.raises(ValueError, match="needs router.group"):
        MoELayer(TopKRouter(H, E, 2), GroupedExperts(E, H, 8), ep_group=group, capacity_factor=1.0)

    for case in ("dropless", "skewed", "capacity"):
        cf = 0.7 if case == "capacity" else None
        kw = dict(E=E, H=H, k=2, shared=True, aux=0.02, z=0.001, capacity_factor=cf)
        ep = make_moe(group=group, ep_group=group, **kw)  # only this rank's E/world experts
        ref = make_moe(group=None, **kw)  # all experts, single process
        if case == "skewed":  # every token picks experts 0 and 1:
            with torch.no_grad():  # the other ranks receive nothing
                for layer in (ep, ref):
                    layer.gate.weight[0], layer.gate.weight[1] = 3.0, 2.7
        assert ep.experts.gate_up_proj.shape[0] == E // world
        assert all(shard_spec(p) is not None and shard_spec(p).kind == "ep" for p in ep.experts.parameters())
        torch.testing.assert_close(
            ep.experts.gate_up_proj, ref.experts.gate_up_proj[rank * E // world : (rank + 1) * E // world]
        )

        xs, gs = _full_tokens(world, H, seed=10)
        if case == "skewed":
            xs = [x.abs() for x in xs]  # positive inputs -> experts 0, 1
        x = xs[rank].clone().requires_grad_()
        with comm_stats.track() as st:
            y = ep(x)
        (y * gs[rank]).sum().backward()
        assert st.calls["all_to_all"] == 3  # forward: counts, tokens out, results back

        # global reference: ep=1, no group, all ranks' tokens at once
        x_all = torch.cat([t.reshape(-1, H) for t in xs])[None].requires_grad_()  # (1, N_total, H)
        g_all = torch.cat([t.reshape(-1, H) for t in gs])[None]
        y_all = ref(x_all)
        (y_all * g_all).sum().backward()
        n_before = sum(t.shape[0] * t.shape[1] for t in xs[:rank])
        n_mine = x.shape[0] * x.shape[1]
        torch.testing.assert_close(y.reshape(-1, H), y_all[0, n_before : n_before + n_mine], **TOL)
        torch.testing.assert_close(x.grad.reshape(-1, H), x_all.grad[0, n_before : n_before + n_mine], **TOL)
        # aux / z losses over all ranks' tokens == single process on all tokens
        torch.testing.assert_close(ep.gate.last_aux_loss, ref.gate.last_aux_loss, **TOL)
        torch.testing.assert_close(ep.gate.last_z_loss, ref.gate.last_z_loss, **TOL)
        torch.testing.assert_close(ep.gate.last_load, ref.gate.last_load)
        # grads: experts gathered over EP, replicated params summed over ranks (each rank saw its tokens)
        ref_g = _grads(ref)
        for name, p in ep.named_parameters():
            got = all_gather(p.grad, dim=0, group=group) if shard_spec(p) is not None else all_reduce(p.grad, group)
            torch.testing.assert_close(got, ref_g[name], **TOL, msg=f"{case}: {name}")
        full = ep.full_expert_state()
        torch.testing.assert_close(full["gate_up_proj"], ref.experts.gate_up_proj.detach())

        if case == "dropless":  # vs a full-expert layer on this rank's tokens only (no communication);
            local = make_moe(group=None, **kw)  # aux losses differ (local stats): leave them out
            x1, x2 = xs[rank].clone().requires_grad_(), xs[rank].clone().requires_grad_()
            with grad_scale(0.0):
                y1, y2 = ep(x1), local(x2)
                (y1 * gs[rank]).sum().backward()
                (y2 * gs[rank]).sum().backward()
            torch.testing.assert_close(y1, y2, **TOL)
            torch.testing.assert_close(x1.grad, x2.grad, **TOL)
        if case == "skewed":
            assert int(ref.gate.last_load[2:].sum()) == 0
        if case == "capacity":
            assert ref.last_dropped > 0
            dropped = all_reduce(ep.last_dropped.reshape(1), group)
            assert int(dropped) == int(ref.last_dropped)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world):
    assert run_distributed(_ep_checks, world) == [True] * world
