"""hfpar.context.ParallelContext: degree validation, the rank layout, model-config checks and the process groups.

    python -m pytest tests/distributed/test_context.py -q

Refusals: ParallelContext.plan raises one ContextError with one line per problem, each naming the offending
value and the valid ones. Layout: rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank (tp
innermost), checked against hand-written rank lists. model_config_problems on tiny transformers configs.
build_groups on 4 gloo ranks: the groups' members equal rank_lists and the EP layout of context.py; at
world 1 without torch.distributed every group is None.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hfpar.context import ContextError, ParallelContext, model_config_problems
from tests.helpers.dist import run_distributed

AXES = ("tp", "dp", "cp", "pp")


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(world=8, tp=3), ["--tp_size 3 does not divide the world size 8", "valid --tp_size here: 1, 2, 4, 8"]),
        (dict(world=6, tp=4), ["--tp_size 4 does not divide the world size 6", "valid --tp_size here: 1, 2, 3, 6"]),
        (dict(world=8, tp=3, cp=2), ["--tp_size 3 x --cp_size 2 = 6 does not divide the world size 8"]),
        (dict(world=8, cp=3), ["--cp_size 3 does not divide the world size 8", "valid --cp_size here: 1, 2, 4, 8"]),
        (
            dict(world=8, tp=2, ep=3),
            ["--ep_size 3 does not divide the data-parallel size 4", "world 8 / tp 2", "valid --ep_size: 1, 2, 4"],
        ),
        (dict(world=6, ep=4), ["--ep_size 4 does not divide the data-parallel size 6", "valid --ep_size: 1, 2, 3, 6"]),
        (
            dict(world=6, cp=2, ep=4),
            [
                "--ep_size 4 does not divide the data-parallel x context-parallel size 3 x 2",
                "valid --ep_size: 1, 2, 3, 6",
            ],
        ),
        (dict(world=4, sequence_parallel=True), ["--sequence_parallel needs --tp_size > 1"]),
        (dict(world=4, tp=0), ["--tp_size 0: must be a positive integer"]),
        (dict(world=4, ep=-2), ["--ep_size -2: must be a positive integer"]),
        (dict(world=4, pp=0), ["--pp_size 0: must be a positive integer"]),
    ],
    ids=[
        "tp-world",
        "tp-world-6",
        "tp-cp-world",
        "cp-world",
        "ep-dp",
        "ep-dp-6",
        "ep-dp-cp",
        "sp-tp1",
        "tp0",
        "ep-neg",
        "pp0",
    ],
)
def test_single_refusal_names_value_and_valid_ones(kwargs, expected):
    world = kwargs.pop("world")
    with pytest.raises(ContextError) as e:
        ParallelContext.plan(world, **kwargs)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for s in expected:
        assert s in msg, (s, msg)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(world=6, ep=4, sequence_parallel=True), ["--ep_size 4 does not divide", "--sequence_parallel needs"]),
        (dict(world=8, tp=3, ep=5, sequence_parallel=False), ["--tp_size 3 does not divide"]),  # no dp: no ep line
        (dict(world=4, tp=0, ep=-1, cp=0), ["--tp_size 0:", "--ep_size -1:", "--cp_size 0:"]),
    ],
    ids=["ep+sp", "tp-hides-ep", "three-non-positive"],
)
def test_all_problems_in_one_error(kwargs, expected):
    world = kwargs.pop("world")
    with pytest.raises(ContextError) as e:
        ParallelContext.plan(world, **kwargs)
    lines = str(e.value).splitlines()
    assert len(lines) == len(expected), lines
    for line, s in zip(lines, expected):
        assert s in line, (s, line)


def test_context_error_is_a_value_error_and_valid_plans_pass():
    assert issubclass(ContextError, ValueError)
    for kw in (
        dict(),
        dict(tp=2),
        dict(tp=2, ep=2),
        dict(ep=4),
        dict(tp=2, sequence_parallel=True),
        dict(tp=2, cp=2, pp=2),
        dict(tp=8),
    ):
        ctx = ParallelContext.plan(8, **kw)
        assert ctx.problems() == []
        assert ctx.pp * ctx.dp * ctx.cp * ctx.tp == 8


# ----------------------------------------------------------------------------- rank layout
LAYOUTS = {  # (world, degrees) -> hand-written groups per axis (+ ep / edp from context.py's docstring)
    "tp2-ep2": (
        8,
        dict(tp=2, ep=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "cp": [[r] for r in range(8)],
            "pp": [[r] for r in range(8)],
            "ep": [[0, 2], [4, 6], [1, 3], [5, 7]],
            "edp": [[0, 4], [2, 6], [1, 5], [3, 7]],
        },
    ),
    "tp2-cp2-pp2": (
        8,
        dict(tp=2, cp=2, pp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[r] for r in range(8)],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "ep": [[0], [2], [1], [3], [4], [6], [5], [7]],
            "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        },
    ),
    "ep4": (
        8,
        dict(ep=4),
        {
            "tp": [[r] for r in range(8)],
            "dp": [list(range(8))],
            "cp": [[r] for r in range(8)],
            "pp": [[r] for r in range(8)],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    # EP drawn from dp x cp (cp innermost): the cp ranks of a replica are in one EP group first
    "tp2-ep2-cp2": (
        8,
        dict(tp=2, ep=2, cp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[r] for r in range(8)],
            "ep": [[0, 2], [4, 6], [1, 3], [5, 7]],
            "edp": [[0, 4], [2, 6], [1, 5], [3, 7]],
        },
    ),
    "ep4-cp2": (
        8,
        dict(ep=4, cp=2),
        {
            "tp": [[r] for r in range(8)],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "pp": [[r] for r in range(8)],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    # a pipeline with EP drawn from each stage's cp (and dp) ranks: EP groups never span two stages
    "tp2-ep2-cp2-pp2": (
        8,
        dict(tp=2, ep=2, cp=2, pp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[r] for r in range(8)],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "edp": [[0], [2], [1], [3], [4], [6], [5], [7]],
        },
    ),
    "ep4-cp2-pp2": (
        8,
        dict(ep=4, cp=2, pp=2),
        {
            "tp": [[r] for r in range(8)],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        },
    ),
}


def _expert_lists(ctx: ParallelContext):
    from hfpar.parallel.groups import expert_rank_lists

    return expert_rank_lists(ctx.rank_lists("dp", "cp"), ctx.ep)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_lists_match_hand_written(name):
    world, deg, want = LAYOUTS[name]
    ctx = ParallelContext.plan(world, **deg)
    for axis in AXES:
        got = ctx.rank_lists(axis)
        assert got == want[axis], (axis, got)
        assert sorted(r for g in got for r in g) == list(range(world)), axis  # each rank in exactly one group
    ep, edp = _expert_lists(ctx)
    assert ep == want["ep"] and edp == want["edp"], (ep, edp)
    for lists in (ep, edp):
        assert sorted(r for g in lists for r in g) == list(range(world))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_coordinates_follow_the_formula(name):
    world, deg, _ = LAYOUTS[name]
    for rank in range(world):
        ctx = ParallelContext.plan(world, rank, **deg)
        c = ctx._coords()
        assert ((c["pp"] * ctx.dp + c["dp"]) * ctx.cp + c["cp"]) * ctx.tp + c["tp"] == rank
        assert (ctx.tp_rank, ctx.dp_rank) == (c["tp"], c["dp"])
        assert ctx.ep_rank == (ctx.dp_rank * ctx.cp + ctx.cp_rank) % ctx.ep
        # the rank's position inside its own group on each axis is its coordinate on that axis
        for axis in AXES:
            group = next(g for g in ctx.rank_lists(axis) if rank in g)
            assert group.index(rank) == c[axis], (axis, rank, group)
        ep_group = next(g for g in _expert_lists(ctx)[0] if rank in g)
        assert ep_group.index(rank) == ctx.ep_rank


def test_tp2_ep2_ranks_by_hand():
    want = {
        0: (0, 0, 0),
        1: (1, 0, 0),
        2: (0, 1, 1),
        3: (1, 1, 1),
        4: (0, 2, 0),
        5: (1, 2, 0),
        6: (0, 3, 1),
        7: (1, 3, 1),
    }  # rank: (tp_rank, dp_rank, ep_rank)
    got = {r: (c.tp_rank, c.dp_rank, c.ep_rank) for r in range(8) for c in [ParallelContext.plan(8, r, tp=2, ep=2)]}
    assert got == want
    ctx = ParallelContext.plan(8, 5, tp=2, ep=2)
    assert ctx.parallelisms == ("tp", "ep") and ctx.model_parallel
    assert ctx.as_dict() == {"world_size": 8, "dp_size": 4, "tp_size": 2, "ep_size": 2, "cp_size": 1, "pp_size": 1}


# ----------------------------------------------------------------------------- model config
def _llama(**kw):
    from transformers import LlamaConfig  # here, not at the top: every spawned rank re-imports this module

    return LlamaConfig(
        **{
            "hidden_size": 48,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "vocab_size": 128,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            **kw,
        }
    )


def _mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{"num_local_experts": 6, **kw},
    )


def test_model_config_heads_and_kv_heads_by_tp():
    p = model_config_problems(ParallelContext.plan(8, tp=4), _llama())
    assert len(p) == 2, p
    assert "--tp_size 4" in p[0] and "num_attention_heads 6" in p[0] and "valid --tp_size: 1, 2, 3, 6" in p[0], p[0]
    assert "--tp_size 4" in p[1] and "num_key_value_heads 2" in p[1] and "valid --tp_size: 1, 2)" in p[1], p[1]


def test_model_config_experts_by_ep():
    p = model_config_problems(ParallelContext.plan(8, ep=4), _mixtral())
    assert len(p) == 1, p
    assert "--ep_size 4" in p[0] and "number of experts 6" in p[0] and "valid --ep_size: 1, 2, 3, 6" in p[0], p[0]


def test_model_config_all_fine_at_tp2():
    ctx = ParallelContext.plan(8, tp=2, ep=2)
    assert model_config_problems(ctx, _llama()) == []
    assert model_config_problems(ctx, _mixtral()) == []
    assert model_config_problems(ctx, None) == []
    # vocab and intermediate size are checked too
    p = model_config_problems(ctx, _llama(vocab_size=129, intermediate_size=131))
    assert len(p) == 2 and "llama's intermediate_size 131" in p[0] and "llama's vocab_size 129" in p[1], p


# ----------------------------------------------------------------------------- process groups
def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


DEGREES = {
    "tp2-ep2": {"tp": 2, "ep": 2},
    "ep2": {"ep": 2},
    "tp2-cp2": {"tp": 2, "cp": 2},
    "ep2-cp2": {"ep": 2, "cp": 2},
}


def _groups_worker(rank: int, world_size: int) -> dict:
    out = {}
    for name, deg in DEGREES.items():
        ctx = ParallelContext.plan(world_size, rank, **deg).build_groups()
        groups = dict(ctx.groups)
        assert ctx.build_groups().groups == groups  # idempotent: no second set of groups
        out[name] = {k: _members(g) for k, g in groups.items()}
        out[name]["props"] = [
            _members(g) for g in (ctx.tp_group, ctx.dp_group, ctx.cp_group, ctx.pp_group, ctx.ep_group, ctx.edp_group)
        ]
    return out


def test_build_groups_on_4_ranks():
    results = run_distributed(_groups_worker, 4, timeout=120)
    layouts = {
        "tp2-ep2": {
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "ep": [[0, 2], [1, 3]],
            "edp": [[0], [1], [2], [3]],
        },
        "ep2": {
            "tp": [[0], [1], [2], [3]],
            "dp": [[0, 1, 2, 3]],
            "ep": [[0, 1], [2, 3]],
            "edp": [[0, 2], [1, 3]],
            "replica": [[0, 1, 2, 3]],
        },
        # rank = cp_rank * tp + tp_rank (dp 1): grads averaged over dp x cp = the cp group here
        "tp2-cp2": {
            "tp": [[0, 1], [2, 3]],
            "cp": [[0, 2], [1, 3]],
            "dp": [[0], [1], [2], [3]],
            "replica": [[0, 2], [1, 3]],
        },
        # rank = dp_rank * cp + cp_rank: EP drawn from dp x cp, the cp ranks of a replica in one EP group
        "ep2-cp2": {
            "cp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "replica": [[0, 1, 2, 3]],
            "ep": [[0, 1], [2, 3]],
            "edp": [[0, 2], [1, 3]],
        },
    }
    for rank, res in enumerate(results):
        for name, want in layouts.items():
            ctx = ParallelContext.plan(4, rank, **DEGREES[name])
            got = res[name]
            mine = {k: next(g for g in v if rank in g) for k, v in want.items()}
            for axis in AXES:
                assert got[axis] == next(g for g in ctx.rank_lists(axis) if rank in g), (rank, name, axis)
            assert {k: got[k] for k in mine} == mine, (rank, name, got)
            assert got["pp"] == [rank] and ("cp2" in name or got["cp"] == [rank])
            assert got["props"] == [got[k] for k in ("tp", "dp", "cp", "pp", "ep", "edp")]


def test_build_groups_without_torch_distributed():
    assert not dist.is_initialized()
    ctx = ParallelContext.plan(1).build_groups()
    assert set(ctx.groups) == {"tp", "dp", "cp", "pp", "ep", "edp", "replica"}
    assert all(g is None for g in ctx.groups.values())
    assert (ctx.tp_group, ctx.dp_group, ctx.ep_group, ctx.edp_group, ctx.cp_group, ctx.pp_group, ctx.replica_group) == (
        None,
    ) * 7
    assert (ctx.tp_rank, ctx.dp_rank, ctx.ep_rank, ctx.parallelisms, ctx.model_parallel) == (0, 0, 0, (), False)
