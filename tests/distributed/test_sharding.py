"""hfpar.parallel.sharding on 2 gloo ranks: the one global grad norm of every sharding kind, and what sits on it.

    python -m pytest tests/distributed/test_sharding.py -q

One spawn of 2 ranks (float64, full tensors drawn from fixed seeds, so every rank knows the full grad) checks
grad_norm against the norm of the full grad for (a) replicated parameters (counted once), (b) TP shards
(dim 0, dim 1, packed splits; a tied parameter passed twice counted once), (c) EP expert slices, (d) an FSDP2
DTensor model vs its unsharded replica, (e) all of them together (sum of squares). Then: sync_partial_grads
sums over partial_grad_group, reduce_dp_grads sums over dp_reduce_group and divides by dp_size, clip_grads_
scales to max_norm (and not below it), full_state_dict gathers TP / packed / EP / FSDP2 shards back under the
original names, and a ShardSpec survives torch.save / torch.load of a parameter (groups come back None). The same shards
as pieces (hfpar.parallel.pieces): joined offline from every rank's piece layout, and cut back out of the full tensors.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hfpar.parallel.pieces import join_pieces, piece_layout, piece_of
from hfpar.parallel.sharding import (
    clip_grads_,
    full_state_dict,
    grad_norm,
    grad_sq_norm,
    local_tensor,
    reduce_dp_grads,
    set_shard_spec,
    shard_spec,
    shard_tensor,
    sync_partial_grads,
)
from tests.helpers.dist import run_distributed

RTOL = 1e-10
PACKED = [4, 2, 2]  # e.g. fused q / k / v rows


def _full(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _param(value: torch.Tensor, grad: torch.Tensor | None = None, **spec) -> nn.Parameter:
    p = nn.Parameter(value.clone())
    p.grad = None if grad is None else grad.clone()
    return set_shard_spec(p, **spec) if spec else p


def _sharded_params(rank: int) -> tuple[dict, dict]:
    """name -> parameter (this rank's part, grad set); name -> full grad. Values equal grads (for state dicts)."""
    w, s = dist.group.WORLD, 2
    full = {
        "rep_a": _full((3, 4), 1),
        "rep_b": _full((5,), 2),
        "tp_dim0": _full((6, 4), 3),
        "tp_dim1": _full((4, 6), 4),
        "tp_packed": _full((8, 3), 5),
        "experts": _full((4, 3, 2), 6),
    }
    local = {
        "rep_a": full["rep_a"],
        "rep_b": full["rep_b"],
        "tp_dim0": shard_tensor(full["tp_dim0"], 0, rank, s),
        "tp_dim1": shard_tensor(full["tp_dim1"], 1, rank, s),
        "tp_packed": shard_tensor(full["tp_packed"], 0, rank, s, PACKED),
        "experts": full["experts"][2 * rank : 2 * rank + 2],
    }
    specs = {
        "tp_dim0": dict(kind="tp", group=w, size=s, dim=0),
        "tp_dim1": dict(kind="tp", group=w, size=s, dim=1),
        "tp_packed": dict(kind="tp", group=w, size=s, dim=0, packed_splits=PACKED),
        "experts": dict(kind="ep", group=w, size=s, dim=0, experts={"num_experts": 4, "start": 2 * rank}),
    }
    return {n: _param(t, t, **specs.get(n, {})) for n, t in local.items()}, full


def _norm(*tensors: torch.Tensor) -> float:
    return float(torch.stack([t.double().square().sum() for t in tensors]).sum().sqrt())


def _fsdp_model(world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()  # 3 rows: uneven shards
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x = _full((5, 4), 7)  # same batch on every rank
    for m in (model, ref):
        m(x).square().sum().backward()
    return model, ref


def _norms(rank: int, world: int) -> dict:
    params, full = _sharded_params(rank)
    model, ref = _fsdp_model(world)
    res = {"fsdp_dtensors": all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())}
    cases = {
        "replicated": (["rep_a", "rep_b"], ["rep_a", "rep_b"]),
        "tp_dim0": (["tp_dim0"], ["tp_dim0"]),
        "tp_dim1": (["tp_dim1"], ["tp_dim1"]),
        "tp_packed": (["tp_packed"], ["tp_packed"]),
        "tp_tied_twice": (["tp_dim0", "tp_dim0", "tp_packed"], ["tp_dim0", "tp_packed"]),
        "ep": (["experts"], ["experts"]),
    }
    for case, (names, want) in cases.items():
        res[case] = (float(grad_norm([params[n] for n in names])), _norm(*(full[n] for n in want)))
    res["fsdp2"] = (float(grad_norm(model.parameters())), _norm(*(p.grad for p in ref.parameters())))
    mix = [*params.values(), params["tp_dim0"], *model.parameters()]
    res["mixture"] = (float(grad_sq_norm(mix)), _norm(*full.values(), *(p.grad for p in ref.parameters())) ** 2)
    res["no_params"] = float(grad_norm([]))
    sd, ref_sd = full_state_dict(model), ref.state_dict()
    res["fsdp_state_dict"] = sorted(sd) == sorted(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    return res


def _reductions(rank: int) -> dict:
    w, base = dist.group.WORLD, _full((3, 2), 8)
    scaled = (rank + 1) * base  # rank 0: base, rank 1: 2 base
    partial = _param(base, scaled, partial_grad_group=w)
    plain = _param(base, scaled)
    no_grad = _param(base, None, partial_grad_group=w)
    res = {
        "partial_n": sync_partial_grads([partial, plain, no_grad, partial]),
        "partial": torch.equal(partial.grad, base + 2 * base),
        "partial_plain": torch.equal(plain.grad, scaled),
        "partial_no_grad": no_grad.grad is None,
    }
    expert = _param(base, scaled, kind="ep", group=w, size=2, dp_reduce_group=w, dp_size=2)
    div_only = _param(base, scaled, kind="ep", dp_size=2)  # dp_size without a group: / only
    plain = _param(base, scaled)
    res["dp_n"] = reduce_dp_grads([expert, div_only, plain])
    res["dp"] = torch.equal(expert.grad, (base + 2 * base) / 2)
    res["dp_div_only"] = torch.equal(div_only.grad, scaled / 2)
    res["dp_plain"] = torch.equal(plain.grad, scaled)
    return res


def _clipping(rank: int) -> dict:
    params, full = _sharded_params(rank)
    n = _norm(*full.values())
    before = {k: p.grad.clone() for k, p in params.items()}
    res = {
        "clip_returned": (float(clip_grads_(params.values(), n / 2)), n),
        "clip_after": (float(grad_norm(params.values())), n / 2),
        "clip_uniform": all(
            torch.allclose(p.grad, before[k] * (n / 2) / n, rtol=1e-6, atol=0) for k, p in params.items()
        ),
    }
    params, _ = _sharded_params(rank)
    before = {k: p.grad.clone() for k, p in params.items()}
    res["below_returned"] = (float(clip_grads_(params.values(), 2 * n)), n)
    res["below_untouched"] = all(torch.equal(p.grad, before[k]) for k, p in params.items())
    return res


def _state(rank: int) -> dict:
    params, full = _sharded_params(rank)
    m = nn.Module()
    for name, p in params.items():
        m.register_parameter(name, p)
    m.register_parameter("tied", params["tp_packed"])  # a second name, one tensor
    sd = full_state_dict(m)
    res = {
        "sd_names": sorted(sd) == sorted([*full, "tied"]),
        "sd_values": {k: torch.equal(sd[k], full[k]) for k in full},
        "sd_tied": sd["tied"] is sd["tp_packed"],
        "sd_local_untouched": tuple(params["tp_packed"].shape) == (4, 3),
    }
    p = params["tp_packed"]
    set_shard_spec(p, partial_grad_group=dist.group.WORLD, dp_reduce_group=dist.group.WORLD, dp_size=2)
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    q = torch.load(buf, weights_only=False)
    a, b = shard_spec(p), shard_spec(q)
    res["saved_fields"] = (b.kind, b.dim, b.size, b.packed_splits, b.dp_size, b.extra) == (
        a.kind,
        a.dim,
        a.size,
        a.packed_splits,
        a.dp_size,
        a.extra,
    ) and torch.equal(q, p)
    res["saved_groups_none"] = (b.group, b.partial_grad_group, b.dp_reduce_group) == (None, None, None)
    res["saved_tp_tag"] = getattr(q, "tensor_model_parallel", None) is True
    res["original_groups_kept"] = a.group is dist.group.WORLD and a.dp_reduce_group is dist.group.WORLD
    return res


def _pieces(rank: int, world: int) -> dict:
    """hfpar.parallel.pieces: every rank's (piece_layout, local tensor) of TP / packed / EP / replicated parameters and
    of FSDP2's DTensors (3 rows over 2 ranks: uneven) join back to the full tensors offline, and piece_of cuts each
    rank's local tensor back out of the full one."""
    params, full = _sharded_params(rank)
    model, ref = _fsdp_model(world)
    live = {**params, **{f"fsdp.{n}": p for n, p in model.named_parameters()}}
    fulls = {**full, **{f"fsdp.{n}": p.detach() for n, p in ref.named_parameters()}}
    mine = {n: (piece_layout(p), local_tensor(p).detach().clone()) for n, p in live.items()}
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "pieces_join": {n: torch.equal(join_pieces([r[n] for r in every]), fulls[n]) for n in live},
        "pieces_cut": {n: torch.equal(piece_of(fulls[n], p), local_tensor(p).detach()) for n, p in live.items()},
    }


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {**_norms(rank, world), **_reductions(rank), **_clipping(rank), **_state(rank), **_pieces(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout=120)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


@pytest.mark.parametrize(
    "case", ["replicated", "tp_dim0", "tp_dim1", "tp_packed", "tp_tied_twice", "ep", "fsdp2", "mixture"]
)
def test_grad_norm_equals_full_grad_norm(ranks, case):
    for rank, res in enumerate(ranks):
        got, want = res[case]
        assert _rel(got, want) < RTOL, (rank, case, got, want)
    assert ranks[0][case][0] == ranks[1][case][0]  # the same on every rank


def test_fsdp2_params_are_dtensors_and_state_dict_gathers(ranks):
    assert all(r["fsdp_dtensors"] and r["fsdp_state_dict"] for r in ranks)
    assert all(r["no_params"] == 0.0 for r in ranks)


def test_sync_partial_grads_sums_over_group(ranks):
    for res in ranks:
        assert res["partial_n"] == 1
        assert res["partial"] and res["partial_plain"] and res["partial_no_grad"], res


def test_reduce_dp_grads_sums_then_divides(ranks):
    for res in ranks:
        assert res["dp_n"] == 2
        assert res["dp"] and res["dp_div_only"] and res["dp_plain"], res


def test_clip_grads_to_max_norm(ranks):
    for res in ranks:
        got, want = res["clip_returned"]
        assert _rel(got, want) < RTOL, (got, want)
        got, want = res["clip_after"]
        assert abs(got - want) < 1e-6, (got, want)
        assert res["clip_uniform"]
        got, want = res["below_returned"]
        assert _rel(got, want) < RTOL and res["below_untouched"]


def test_full_state_dict_gathers_shards(ranks):
    for res in ranks:
        assert res["sd_names"] and res["sd_tied"] and res["sd_local_untouched"]
        assert all(res["sd_values"].values()), res["sd_values"]


def test_shard_spec_survives_save_load(ranks):
    for res in ranks:
        assert res["saved_fields"] and res["saved_groups_none"] and res["saved_tp_tag"], res
        assert res["original_groups_kept"]


def test_pieces_join_to_full_tensors_and_cut_back(ranks):
    for r in ranks:
        assert all(r["pieces_join"].values()), r["pieces_join"]
        assert all(r["pieces_cut"].values()), r["pieces_cut"]
