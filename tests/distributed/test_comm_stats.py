"""hfpar.observe.comm_stats counts what each rank hands to collectives, exactly, on 2 gloo ranks.

python -m pytest tests/distributed/test_comm_stats.py -q
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _worker(rank: int, world_size: int) -> dict:
    from hfpar.observe.comm_stats import CommCounter

    c = CommCounter().install()
    try:
        t = torch.ones(1000)  # 4000 bytes
        dist.all_reduce(t)
        out = torch.empty(2000)
        dist.all_gather_into_tensor(out, torch.ones(1000))  # gathered: 8000 bytes
        dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))  # input: 4000 bytes
        splits = [3, 1] if rank == 0 else [2, 2]  # rows of 10 floats
        recv = [3, 2] if rank == 0 else [1, 2]
        dist.all_to_all_single(torch.empty(sum(recv), 10), torch.ones(sum(splits), 10), recv, splits)
        first = c.snapshot()
        # DDP: buckets go through the stock all-reduce hook and are counted once
        c.reset()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 10))
        c.watch_ddp(model)
        c.reset()  # DDP's constructor broadcasts the parameters
        model(torch.ones(4, 10)).sum().backward()
        ddp = c.snapshot()
    finally:
        c.uninstall()
    dist.all_reduce(torch.ones(1))
    return {"first": first, "ddp": ddp, "after_uninstall": c.snapshot()}


def test_counts_match_the_tensors_handed_over():
    res = run_distributed(_worker, 2, timeout=120)
    for rank, r in enumerate(res):
        f = r["first"]
        assert f["all_reduce"] == {"calls": 1, "payload": 4000, "wire": 4000.0}  # 2 (N-1)/N
        assert f["all_gather"] == {"calls": 1, "payload": 8000, "wire": 4000.0}  # (N-1)/N
        assert f["reduce_scatter"] == {"calls": 1, "payload": 4000, "wire": 2000.0}
        sent_to_other = (1 if rank == 0 else 2) * 10 * 4  # rows for the other rank
        assert f["all_to_all"]["wire"] == sent_to_other, f["all_to_all"]
        grads = (10 * 10 + 10) * 4
        assert r["ddp"] == {"all_reduce": {"calls": 1, "payload": grads, "wire": float(grads)}}, r["ddp"]
        assert r["after_uninstall"] == r["ddp"]  # uninstalled: the last all-reduce was not counted


def _moe_worker(rank: int, world_size: int) -> dict:
    """An expert-parallel MoELayer (4 experts over 2 ranks, top-2): its routed / received row counters
    against the all-to-all bytes the counter saw, forward alone and forward + backward."""
    from hfpar.observe.comm_stats import CommCounter
    from hfpar.parallel.expert_parallel.moe import GroupedExperts, MoELayer, TopKRouter

    H, E = 16, 4
    torch.manual_seed(0)  # same weights on both ranks
    moe = MoELayer(TopKRouter(H, E, 2, aux_loss_coef=0.0), GroupedExperts(E, H, 24), ep_group=dist.group.WORLD)
    torch.manual_seed(1 + rank)  # different tokens: uneven routing
    x = torch.randn(3, 5 + 4 * rank, H, requires_grad=True)
    c = CommCounter().install()
    try:
        y = moe(x)
        fwd = c.snapshot()
        y.square().sum().backward()
        both = c.snapshot()
    finally:
        c.uninstall()
    return {"fwd": fwd, "both": both, "routed": moe.routed_remote_rows, "received": moe.received_remote_rows}


def test_moe_routed_rows_match_all_to_all_bytes():
    H, E = 16, 4
    res = run_distributed(_moe_worker, 2, timeout=120)
    counts_wire = (E // 2) * 8  # per-expert counts (int64) for the other rank's experts
    for r in res:
        assert isinstance(r["routed"], int) and isinstance(r["received"], int)
        a2a = r["fwd"]["all_to_all"]
        assert a2a["calls"] == 3, a2a  # counts, dispatch, combine
        # dispatch sends the copies routed to the other rank's experts, combine sends back the received ones
        assert a2a["wire"] - counts_wire == (r["routed"] + r["received"]) * H * 4, (a2a, r)
        # backward sends both again (the counts exchange has no backward)
        assert r["both"]["all_to_all"]["wire"] - counts_wire == 2 * (a2a["wire"] - counts_wire), r
    # 2 ranks: what rank 0 routes away rank 1 receives and vice versa
    assert res[0]["routed"] == res[1]["received"] and res[1]["routed"] == res[0]["received"]
    assert res[0]["routed"] != res[1]["routed"]  # uneven token counts: the per-rank check is not trivial
    # the brief's form: summed over ranks, routed rows = forward token wire bytes / (H * 4) / 2
    token_wire = sum(r["fwd"]["all_to_all"]["wire"] - counts_wire for r in res)
    assert sum(r["routed"] for r in res) == token_wire / (H * 4) / 2


def _p2p_worker(rank: int, world_size: int) -> dict:
    """Point to point: one batch_isend_irecv of known sizes, then the overlapped ring attention (forward +
    backward) seen by the counter and by hfpar.parallel.comm's comm_stats at once."""
    from hfpar.observe.comm_stats import CommCounter
    from hfpar.parallel.comm import comm_stats
    from hfpar.parallel.context_parallel import (
        ring_attention,
        shard_batch,
        zigzag_indices,
    )

    other = 1 - rank
    c = CommCounter().install()
    try:
        send, recv = torch.ones(1000 + 500 * rank), torch.empty(1000 + 500 * other)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, other), dist.P2POp(dist.irecv, recv, other)]):
            w.wait()
        direct = c.snapshot()
        c.reset()
        T, H, HKV, D = 32, 4, 2, 8
        g = torch.Generator().manual_seed(0)
        pos = torch.cat([torch.arange(12), torch.arange(20)])[None]  # two documents
        _, rows = shard_batch({"input_ids": torch.zeros(1, T, dtype=torch.long), "position_ids": pos}, rank, 2)
        idx = zigzag_indices(T, rank, 2)
        q, k, v = (torch.randn(1, n, T, D, generator=g)[:, :, idx].requires_grad_() for n in (H, HKV, HKV))
        with comm_stats.track() as s:
            out = ring_attention(q, k, v, rows, dist.group.WORLD, overlap=True)
            out.backward(torch.ones_like(out))
        ring = c.snapshot()
    finally:
        c.uninstall()
    return {"direct": direct, "ring": ring, "comm_stats_send": s.snapshot().get("send"), "shard_bytes": k.numel() * 4}


def test_counts_point_to_point_sends_of_the_ring():
    res = run_distributed(_p2p_worker, 2, timeout=120)
    for rank, r in enumerate(res):
        sent = (1000 + 500 * rank) * 4  # what this rank sends, not what it receives
        assert r["direct"] == {"send": {"calls": 1, "payload": sent, "wire": float(sent)}}, r["direct"]
        # cp = 2, per rank (ring.py): K and V once forward (cp - 1); backward K and V once and dK and dV twice (cp)
        ring = r["ring"]
        assert set(ring) == {"send"} and ring["send"]["wire"] == 8 * r["shard_bytes"], ring
        assert ring["send"]["payload"] == r["comm_stats_send"]["bytes"], (ring, r["comm_stats_send"])
