"""Autograd-aware collectives for tensor / sequence / expert parallelism, in conjugate pairs.

Each public function is one `torch.autograd.Function` whose backward is the conjugate (adjoint)
collective of its forward:

    forward                                  backward
    copy_to_parallel_region        identity             all-reduce
    reduce_from_parallel_region    all-reduce           identity
    scatter_to_parallel_region     split last dim       all-gather last dim
    gather_from_parallel_region    all-gather last dim  split last dim
    scatter_to_sequence_parallel_region       split dim       all-gather dim
    gather_from_sequence_parallel_region      all-gather dim  reduce-scatter dim (or split)
    reduce_scatter_to_sequence_parallel_region reduce-scatter all-gather dim
    all_to_all_single_autograd     all-to-all (dim 0)   the reverse all-to-all

Every function takes an explicit `group` (None = the default group), never modifies its input,
works on any backend (gloo on CPU, NCCL on CUDA), and is an exact no-op (`out is x`) when the
group has one rank or torch.distributed is not initialised. Split / gather dims must divide evenly.

Usage (2 CPU processes; `torchrun --nproc_per_node 2 -m hfpar.parallel.comm` runs this example, checked):

    x = torch.randn(4, 6, requires_grad=True)            # (B, H), same on every rank
    y = scatter_to_parallel_region(x)                    # (B, H/tp): this rank's columns
    z = gather_from_parallel_region(y * 2)               # (B, H)
    z.sum().backward()                                   # x.grad == 2 everywhere

Communication accounting: `with comm_stats.track() as s: ...` then `s.bytes` / `s.calls` per
collective type ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"). Bytes counted are the
bytes of the full (unsharded) buffer for all-reduce / all-gather / reduce-scatter and the bytes this
rank sends for all-to-all. When disabled the cost is one attribute check per collective.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "comm_stats",
    "group_size",
    "group_rank",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "scatter_to_parallel_region",
    "gather_from_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_to_all_single_autograd",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "split",
]


# ----------------------------------------------------------------------------- accounting
class CommStats:
    """Bytes and call counts per collective type; off by default, cheap when off."""

    def __init__(self) -> None:
        self.enabled = False
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, op: str, nbytes: int) -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {op: {"bytes": self.bytes[op], "calls": self.calls[op]} for op in sorted(self.calls)}

    @contextlib.contextmanager
    def track(self, reset: bool = True):
        """Enable counting inside the block (reset first unless reset=False); yields self."""
        if reset:
            self.reset()
        prev, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = prev


comm_stats = CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- group helpers
def group_size(group=None) -> int:
    """World size of `group`; 1 when torch.distributed is not available / initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """Rank of this process in `group`; 0 when torch.distributed is not available / initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of the *_single
# names (same semantics); the GPU machine runs torch 2.11, which only has the old names.
def _all_gather_base(out: torch.Tensor, x: torch.Tensor, group=None):
    # looked up at call time, so that byte counters installed on torch.distributed (--log_comm_bytes) see it
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_base(out: torch.Tensor, x: torch.Tensor, group=None):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


# Flipped to True (with one warning) the first time a backend rejects reduce-scatter (old gloo builds
# had no reduce_scatter_tensor on CPU; torch 2.13's gloo does). The rejection happens before any data is
# exchanged, so falling back to all-reduce + slice is safe (it moves ~2x the bytes).
_reduce_scatter_unsupported = False


def _divide(n: int, ws: int, what: str) -> int:
    if n % ws:
        raise ValueError(f"{what}: size {n} is not divisible by the group size {ws}")
    return n // ws


# ----------------------------------------------------------------------------- raw collectives
# Plain (non-autograd) out-of-place collectives along an arbitrary dim; the building blocks.
def all_reduce(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.contiguous().clone()
    if comm_stats.enabled:
        comm_stats.record("all_reduce", _nbytes(out))
    dist.all_reduce(out, op=op, group=group)
    return out


def _result(x: torch.Tensor, dim: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the result, shaped as `x` with `n` along `dim`, or None; the dim-first contiguous buffer a collective
    writes). Where the dims before `dim` are all 1 (dim 0, or a (1, T, H) packed row along dim 1) the buffer is a
    view of the result, which is then a tensor of its own, never a view (an autograd Function's output that is a view
    of a tensor made inside it cannot be modified in place: Falcon's `mlp_output += attention_output`). Else None:
    the caller moves dim back, and .contiguous() of the permuted buffer copies it."""
    dim %= x.dim()
    shape = list(x.shape)
    shape[dim] = n
    if math.prod(shape[:dim]) == 1:
        out = x.new_empty(shape)
        return out, out.movedim(dim, 0)
    return None, x.new_empty((n, *shape[:dim], *shape[dim + 1 :]))


def all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    ws = group_size(group)
    x0 = x.movedim(dim, 0).contiguous()  # gather dim in front
    res, out = _result(x, dim, ws * x0.shape[0])
    if comm_stats.enabled:
        comm_stats.record("all_gather", _nbytes(out))
    _all_gather_base(out, x0, group=group)
    return res if res is not None else out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum `x` over ranks and keep this rank's chunk along `dim`."""
    global _reduce_scatter_unsupported
    ws = group_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    n = _divide(x0.shape[0], ws, f"reduce_scatter along dim {dim} of shape {tuple(x.shape)}")
    if not _reduce_scatter_unsupported:
        if comm_stats.enabled:
            comm_stats.record("reduce_scatter", _nbytes(x0))
        res, out = _result(x, dim, n)
        try:
            _reduce_scatter_base(out, x0, group=group)
            return res if res is not None else out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError) as e:  # backend has no reduce-scatter
            if "support" not in str(e).lower() and "implement" not in str(e).lower():
                raise
            _reduce_scatter_unsupported = True
            warnings.warn(
                f"hfpar: the {dist.get_backend(group)} backend rejected reduce_scatter ({e}); this "
                "process now uses all_reduce + slice instead for every reduce-scatter (same result, "
                "about 2x the bytes)",
                RuntimeWarning,
                stacklevel=2,
            )
    full = all_reduce(x0, group)  # fallback: (ws*n, ...) summed
    return full.narrow(0, group_rank(group) * n, n).movedim(0, dim).clone(memory_format=torch.contiguous_format)


def split(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (a fresh contiguous tensor)."""
    ws, r = group_size(group), group_rank(group)
    n = _divide(x.shape[dim], ws, f"split along dim {dim} of shape {tuple(x.shape)}")
    return x.narrow(dim, r * n, n).clone(memory_format=torch.contiguous_format)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if comm_stats.enabled:
        comm_stats.record("all_to_all", _nbytes(x))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


# ----------------------------------------------------------------------------- autograd pairs
class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Split(torch.autograd.Function):
    """fwd: keep own chunk along dim / bwd: all-gather along dim."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """fwd: all-gather along dim / bwd: reduce-scatter (grad is partial per rank) or split."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        fn = reduce_scatter if ctx.reduce_grad else split
        return fn(g, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """fwd: reduce-scatter along dim / bwd: all-gather along dim."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """fwd: all-to-all along dim 0 / bwd: the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient backward. Enter a TP region."""
    return x if group_size(group) == 1 else _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward. Leave a TP region holding partial sums."""
    return x if group_size(group) == 1 else _ReduceFromParallelRegion.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., H) -> (..., H/tp) own chunk of the last dim; backward all-gathers the last dim."""
    return x if group_size(group) == 1 else _Split.apply(x, x.dim() - 1, group)


def gather_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., H/tp) -> (..., H) all-gather of the last dim; backward keeps own chunk of the grad."""
    return x if group_size(group) == 1 else _Gather.apply(x, x.dim() - 1, group, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """(B, T, H) -> (B, T/tp, H) own chunk of `dim`; backward all-gathers along `dim`."""
    return x if group_size(group) == 1 else _Split.apply(x, dim % x.dim(), group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, dim: int = 1, group=None, *, reduce_grad: bool = True
) -> torch.Tensor:
    """(B, T/tp, H) -> (B, T, H) all-gather along `dim`.

    Backward reduce-scatters the gradient (right when the gathered tensor feeds a tensor-parallel
    op, so each rank holds a partial gradient). With reduce_grad=False the backward only keeps
    this rank's chunk (right when the consumer is replicated, e.g. a loss computed on every rank).
    """
    return x if group_size(group) == 1 else _Gather.apply(x, dim % x.dim(), group, reduce_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """(B, T, H) partial sums -> (B, T/tp, H) summed, own chunk; backward all-gathers along `dim`."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, dim % x.dim(), group)


def _as_splits(s, n: int, ws: int, what: str) -> list[int]:
    if s is None:
        return [_divide(n, ws, f"all_to_all {what} (even split)")] * ws
    s = s.tolist() if isinstance(s, torch.Tensor) else [int(v) for v in s]
    if len(s) != ws:
        raise ValueError(f"all_to_all {what}: {len(s)} split sizes for a group of {ws} ranks")
    return s


def all_to_all_single_autograd(
    x: torch.Tensor,
    output_split_sizes: Sequence[int] | torch.Tensor | None,
    input_split_sizes: Sequence[int] | torch.Tensor | None,
    group=None,
) -> torch.Tensor:
    """All-to-all along dim 0 with (possibly uneven) splits, differentiable.

    x: (sum(input_split_sizes), *rest); row block i goes to rank i. Returns
    (sum(output_split_sizes), *rest) where row block j came from rank j. None = even split.
    Backward sends the gradient blocks back with the splits swapped. Same name and argument
    order as torch.distributed._functional_collectives.all_to_all_single_autograd.
    """
    ws = group_size(group)
    if ws == 1:
        return x
    in_splits = _as_splits(input_split_sizes, x.shape[0], ws, "input_split_sizes")
    if sum(in_splits) != x.shape[0]:
        raise ValueError(
            f"all_to_all: input_split_sizes {in_splits} sum to {sum(in_splits)}, but x has {x.shape[0]} rows"
        )
    out_splits = _as_splits(output_split_sizes, x.shape[0], ws, "output_split_sizes")
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _demo(rank: int, world_size: int) -> None:
    """The module docstring's example, checked."""
    torch.manual_seed(0)
    x = torch.randn(4, 2 * world_size, requires_grad=True)  # (B, H)
    y = scatter_to_parallel_region(x)  # (B, H/tp)
    z = gather_from_parallel_region(y * 2)  # (B, H)
    z.sum().backward()
    assert torch.allclose(z, 2 * x) and torch.equal(x.grad, torch.full_like(x, 2.0))
    if rank == 0:
        print("ok:", tuple(x.shape), "->", tuple(y.shape), "->", tuple(z.shape))


if __name__ == "__main__":  # torchrun --nproc_per_node 2 -m hfpar.parallel.comm
    dist.init_process_group("gloo")
    try:
        _demo(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
