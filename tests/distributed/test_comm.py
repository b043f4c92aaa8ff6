"""hfpar.parallel.comm: every conjugate pair, forward and backward, against the expected math.

One spawn per world size (2 and 4 gloo ranks on CPU) runs all the checks; float64 throughout.
Each rank can rebuild every other rank's tensors (seeded by rank), so expectations are computed
locally, with no collective involved.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from hfpar.parallel import comm
from hfpar.parallel.comm import (
    all_to_all_single_autograd,
    comm_stats,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
    scatter_to_sequence_parallel_region,
)
from tests.helpers.dist import run_distributed

SHAPE = (4, 8, 12)  # (B, T, H): every dim divisible by 2 and 4


def _t(seed: int, rank: int, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-12, f"{what}: max abs error {err}"


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _run(y: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (y * g).sum().backward()  # not y.backward(g): that lazily imports sympy (~3 s per rank)
    return x.grad


def _comm_checks(rank: int, ws: int) -> int:
    group = dist.group.WORLD
    n = 0
    for seed, dim in enumerate([1, 0, 2, -1], start=1):
        xs = [_t(seed, r) for r in range(ws)]  # every rank's input
        gs = [_t(seed + 50, r) for r in range(ws)]  # every rank's upstream grad (full shape)
        x, g = xs[rank], gs[rank]
        d = dim % 3
        chunk = lambda t: t.chunk(ws, d)[rank]  # noqa: E731

        # copy_to (fwd identity / bwd all-reduce)
        if dim == 1:
            xl = _leaf(x)
            y = copy_to_parallel_region(xl, group)
            _close(y, x, "copy_to fwd")
            _close(_run(y, g, xl), sum(gs), "copy_to bwd")
            # reduce_from (fwd all-reduce / bwd identity)
            xl = _leaf(x)
            y = reduce_from_parallel_region(xl, group)
            _close(y, sum(xs), "reduce_from fwd")
            _close(_run(y, g, xl), g, "reduce_from bwd")
            assert torch.equal(x, xs[rank]), "input modified in place"
            # scatter_to (last dim) / gather_from (last dim)
            xl = _leaf(xs[0])  # replicated input
            y = scatter_to_parallel_region(xl, group)
            _close(y, xs[0].chunk(ws, -1)[rank], "scatter_to fwd")
            gl = [gg.chunk(ws, -1)[r] for r, gg in enumerate(gs)]
            _close(_run(y, gl[rank], xl), torch.cat(gl, -1), "scatter_to bwd (all-gather)")
            xl = _leaf(x.chunk(ws, -1)[0])  # (B, T, H/tp), differs per rank
            y = gather_from_parallel_region(xl, group)
            _close(y, torch.cat([t.chunk(ws, -1)[0] for t in xs], -1), "gather_from fwd")
            _close(_run(y, g, xl), g.chunk(ws, -1)[rank], "gather_from bwd (split)")
            n += 6

        # sequence-parallel pair along `dim`
        xl = _leaf(xs[0])
        y = scatter_to_sequence_parallel_region(xl, dim, group)
        _close(y, chunk(xs[0]), f"scatter_to_sequence dim={dim} fwd")
        gl = [gg.chunk(ws, d)[r] for r, gg in enumerate(gs)]
        _close(_run(y, gl[rank], xl), torch.cat(gl, d), f"scatter_to_sequence dim={dim} bwd")

        xl = _leaf(chunk(x))  # (B, T/tp, H) per rank
        y = gather_from_sequence_parallel_region(xl, dim, group)
        _close(y, torch.cat([xs[r].chunk(ws, d)[r] for r in range(ws)], d), f"gather_from_sequence dim={dim} fwd")
        _close(_run(y, g, xl), chunk(sum(gs)), f"gather_from_sequence dim={dim} bwd (reduce-scatter)")
        xl = _leaf(chunk(x))
        y = gather_from_sequence_parallel_region(xl, dim, group, reduce_grad=False)
        _close(_run(y, g, xl), chunk(g), f"gather_from_sequence dim={dim} reduce_grad=False bwd (split)")

        xl = _leaf(x)  # partial sums
        y = reduce_scatter_to_sequence_parallel_region(xl, dim, group)
        _close(y, chunk(sum(xs)), f"reduce_scatter_to_sequence dim={dim} fwd")
        gl = [gg.chunk(ws, d)[r] for r, gg in enumerate(gs)]
        _close(_run(y, gl[rank], xl), torch.cat(gl, d), f"reduce_scatter_to_sequence dim={dim} bwd (all-gather)")
        n += 5

    # the all-reduce + slice fallback for backends without reduce-scatter gives the same result
    comm._reduce_scatter_unsupported = True
    try:
        xl = _leaf(_t(6, rank))
        y = reduce_scatter_to_sequence_parallel_region(xl, 1, group)
        _close(y, sum(_t(6, r) for r in range(ws)).chunk(ws, 1)[rank], "reduce_scatter fallback fwd")
        xl = _leaf(_t(6, rank).chunk(ws, 1)[rank])
        y = gather_from_sequence_parallel_region(xl, 1, group)
        _close(
            _run(y, _t(8, rank), xl), sum(_t(8, r) for r in range(ws)).chunk(ws, 1)[rank], "reduce_scatter fallback bwd"
        )
    finally:
        comm._reduce_scatter_unsupported = False
    n += 2

    # non-contiguous input (a transpose) is gathered / reduce-scattered correctly
    xt = _leaf(_t(7, rank, (12, 2, 8))).transpose(0, 2)  # (8, 2, 12) non-contiguous view
    y = gather_from_sequence_parallel_region(xt, 0, group)
    _close(y, torch.cat([_t(7, r, (12, 2, 8)).transpose(0, 2) for r in range(ws)], 0), "gather non-contiguous")
    y = reduce_scatter_to_sequence_parallel_region(xt, 2, group)
    _close(
        y,
        sum(_t(7, r, (12, 2, 8)).transpose(0, 2) for r in range(ws)).chunk(ws, 2)[rank],
        "reduce_scatter non-contiguous",
    )
    n += 2

    # all_to_all with uneven splits (zeros included): S[i][j] rows go from rank i to rank j
    S = [[(i + 2 * j + 1) % 4 for j in range(ws)] for i in range(ws)]
    S[0][ws - 1] = 0
    xs = [_t(20, i, (sum(S[i]), 3)) for i in range(ws)]
    gs = [_t(21, j, (sum(S[i][j] for i in range(ws)), 3)) for j in range(ws)]
    blocks = [list(xs[i].split(S[i], 0)) for i in range(ws)]
    out_splits = [S[i][rank] for i in range(ws)]
    for as_tensor in (False, True):
        xl = _leaf(xs[rank])
        split_in = torch.tensor(S[rank]) if as_tensor else S[rank]
        y = all_to_all_single_autograd(xl, out_splits, split_in, group)
        _close(y, torch.cat([blocks[i][rank] for i in range(ws)], 0), "all_to_all fwd")
        gblocks = [list(gs[j].split([S[i][j] for i in range(ws)], 0)) for j in range(ws)]
        _close(_run(y, gs[rank], xl), torch.cat([gblocks[j][rank] for j in range(ws)], 0), "all_to_all bwd")
        n += 2
    # even split (None)
    xl = _leaf(_t(22, rank, (2 * ws, 3)))
    y = all_to_all_single_autograd(xl, None, None, group)
    _close(y, torch.cat([_t(22, i, (2 * ws, 3)).chunk(ws, 0)[rank] for i in range(ws)], 0), "all_to_all even")
    n += 1

    # CommStats: counts when enabled, silent when disabled
    comm_stats.reset()
    copy_to_parallel_region(_leaf(xs[0][:1]), group)
    reduce_from_parallel_region(torch.ones(4, dtype=torch.float64), group)
    assert not comm_stats.calls, "CommStats recorded while disabled"
    with comm_stats.track() as s:
        reduce_from_parallel_region(torch.ones(4, dtype=torch.float64), group)  # 32 bytes
        gather_from_sequence_parallel_region(torch.ones(2, 3), 0, group)  # ws*24 bytes out
        reduce_scatter_to_sequence_parallel_region(torch.ones(2 * ws, 1), 0, group)  # ws*8 bytes in
        all_to_all_single_autograd(torch.ones(ws, 2), None, None, group)  # ws*8 bytes sent
    assert s.snapshot() == {
        "all_reduce": {"bytes": 32, "calls": 1},
        "all_gather": {"bytes": 24 * ws, "calls": 1},
        "reduce_scatter": {"bytes": 8 * ws, "calls": 1},
        "all_to_all": {"bytes": 8 * ws, "calls": 1},
    }, s.snapshot()
    assert not comm_stats.enabled
    n += 1

    # size-1 sub-groups: every function returns its input object unchanged
    singles = [dist.new_group([r]) for r in range(ws)]  # every rank creates every group
    one = singles[rank]
    x = _leaf(_t(30, rank))
    for f in (
        copy_to_parallel_region,
        reduce_from_parallel_region,
        scatter_to_parallel_region,
        gather_from_parallel_region,
    ):
        assert f(x, one) is x, f.__name__
    for f in (
        scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    ):
        assert f(x, 1, one) is x, f.__name__
    assert all_to_all_single_autograd(x, [2], [2], one) is x
    n += 1

    # a sub-group of ranks {0, 1} (ws=4 only): group-relative chunks, other ranks untouched
    if ws == 4:
        pair = dist.new_group([0, 1])
        if rank < 2:
            xs2 = [_t(40, r) for r in range(2)]
            xl = _leaf(xs2[rank])
            y = reduce_scatter_to_sequence_parallel_region(xl, 1, pair)
            _close(y, sum(xs2).chunk(2, 1)[rank], "sub-group reduce_scatter")
        n += 1

    # a packed row (1, T, H) or dim 0: the output is a tensor of its own, not a view made inside the Function, so
    # the model may add to it in place (Falcon's `mlp_output += attention_output` after the SP reduce-scatter)
    for shape, dim in (((1, 4 * ws, 3), 1), ((2 * ws, 3), 0), ((1, 4 * ws, 3), -2), ((2, 3, 2 * ws), -1)):
        xs3 = [_t(50, r, shape) for r in range(ws)]
        y = reduce_scatter_to_sequence_parallel_region(_leaf(xs3[rank]), dim, group)
        y += 1  # raised "Output 0 of _ReduceScatter is a view and is being modified inplace" before
        _close(y, sum(xs3).chunk(ws, dim)[rank] + 1, f"reduce_scatter of {shape} along {dim}, then += 1")
        y = gather_from_sequence_parallel_region(_leaf(xs3[rank]), dim, group)
        y += 1
        _close(y, torch.cat(xs3, dim) + 1, f"all_gather of {shape} along {dim}, then += 1")
        n += 1

    # uneven sizes fail loudly, naming the shape
    with pytest.raises(ValueError, match="not divisible"):
        scatter_to_sequence_parallel_region(torch.ones(2, 2 * ws + 1, 3), 1, group)
    with pytest.raises(ValueError, match="split sizes"):
        all_to_all_single_autograd(torch.ones(3, 1), [1, 1, 1, 1, 1], [3], group)
    n += 1
    return n


@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_pairs(world_size):
    counts = run_distributed(_comm_checks, world_size)
    assert all(c == counts[0] and c > 20 for c in counts), counts


def test_no_process_group_is_noop():
    assert not dist.is_initialized()
    x = torch.randn(2, 4, 6, requires_grad=True)
    for f in (
        comm.copy_to_parallel_region,
        comm.reduce_from_parallel_region,
        comm.scatter_to_parallel_region,
        comm.gather_from_parallel_region,
        comm.scatter_to_sequence_parallel_region,
        comm.gather_from_sequence_parallel_region,
        comm.reduce_scatter_to_sequence_parallel_region,
    ):
        assert f(x) is x, f.__name__
    assert comm.all_to_all_single_autograd(x, [2], [2]) is x
    assert comm.group_size() == 1 and comm.group_rank() == 0


def test_reduce_scatter_fallback_warns_once_naming_the_backend(monkeypatch, tmp_path):
    """A backend that rejects reduce-scatter: one RuntimeWarning naming the backend and the all-reduce
    fallback, then the fallback without another warning; other errors still raise. One in-process rank."""

    def rejected(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    monkeypatch.setattr(comm, "_reduce_scatter_base", rejected)
    monkeypatch.setattr(comm, "_reduce_scatter_unsupported", False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.arange(6.0).reshape(2, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [comm.reduce_scatter(x, 0), comm.reduce_scatter(x, 1)]
        assert all(torch.equal(o, x) for o in outs)  # one rank: the sum is x, the chunk all of it
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1, msgs
        assert "the gloo backend rejected reduce_scatter" in msgs[0] and "all_reduce + slice" in msgs[0], msgs[0]
        assert comm._reduce_scatter_unsupported

        def broken(*args, **kwargs):
            raise RuntimeError("Connection closed by peer")

        monkeypatch.setattr(comm, "_reduce_scatter_base", broken)
        monkeypatch.setattr(comm, "_reduce_scatter_unsupported", False)
        with pytest.raises(RuntimeError, match="Connection closed"):
            comm.reduce_scatter(x, 0)
        assert not comm._reduce_scatter_unsupported
    finally:
        dist.destroy_process_group()


def _fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 blocks here until the harness terminates it


def test_run_distributed_reports_rank_failure():
    with pytest.raises(AssertionError, match="boom from rank 1"):
        run_distributed(_fails, 2, timeout=60)
