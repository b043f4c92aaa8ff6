"""hfpar.backends.reshard.resume_mode: which checkpoint meshes resume natively, through the full form, or are refused
in one line naming both meshes (the preflight's decision, from trainer_state.json alone; no launch).

    python -m pytest -q tests/unit/test_backends_reshard.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hfpar.backends import STRATEGY, SUPPORT
from hfpar.backends.reshard import resume_mode


def _ctx(strategy: str, world: int, **sizes) -> SimpleNamespace:
    s = {"tp": 1, "ep": 1, "cp": 1, "pp": 1, **sizes}
    return SimpleNamespace(world=world, dp=world // (s["tp"] * s["cp"] * s["pp"]), strategy=STRATEGY[strategy], **s)


def _state(strategy: str, world: int, reshardable: bool = True, **sizes) -> dict:
    c = _ctx(strategy, world, **sizes)
    return {
        "strategy": strategy,
        "world_size": world,
        "dp": c.dp,
        "tp": c.tp,
        "ep": c.ep,
        "cp": c.cp,
        "pp": c.pp,
        "pp_virtual_stages": 1,
        "reshardable": reshardable,
    }


def _mode(state: dict, strategy: str, world: int, key: str = "none", **sizes):
    return resume_mode(SUPPORT[(strategy, key)], state, _ctx(strategy, world, **sizes), 1)


@pytest.mark.parametrize(
    "src, dst, want",
    [
        (("ddp", 2, {}), ("ddp", 2, "none", {}), "native"),  # the same mesh
        (("ddp", 2, {}), ("single", 1, "none", {}), "native"),  # DDP's full state on another world size
        (("ddp", 2, {"cp": 2}), ("single", 1, "none", {}), "native"),  # cp 2 -> cp 1: the same full state
        (("fsdp2", 4, {}), ("fsdp2", 2, "none", {}), "native"),  # DCP reshards on load
        (("zero2", 2, {}), ("zero2", 1, "none", {}), "reshard"),  # ZeRO partitions of another dp size
        (("zero3", 2, {}), ("fsdp2", 2, "none", {}), "reshard"),  # another layout family
        (("ddp", 2, {"tp": 2}), ("single", 1, "none", {}), "reshard"),  # tp 2 -> tp 1
        (("ddp", 4, {"tp": 2}), ("ddp", 2, "tp", {"tp": 2}), "reshard"),  # tp 2 x dp 2 -> tp 2 x dp 1
        (("ddp", 2, {"pp": 2}), ("ddp", 2, "tp", {"tp": 2}), "reshard"),  # pp 2 -> tp 2
        (("ddp", 2, {"tp": 2}), ("ddp", 2, "tp", {"tp": 2}), "native"),  # TP on its own mesh: its rank files
    ],
)
def test_resume_mode(src, dst, want):
    (s, sw, ssz), (d, dw, key, dsz) = src, dst
    assert _mode(_state(s, sw, **ssz), d, dw, key, **dsz) == (want, None)


def test_refusals_name_both_meshes_in_one_line():
    # a writer with no full form (TP x ZeRO-1, or an older hfpar's checkpoint)
    mode, why = _mode(_state("zero1", 2, reshardable=False, tp=2), "ddp", 2)
    assert mode is None and "\n" not in why
    assert "zero1 x 2 processes (dp 1 tp 2 ep 1 cp 1 pp 1)" in why and "ddp x 2 processes (dp 2 tp 1" in why
    assert "records no full form" in why
    # a target that cannot load the full form: ZeRO-3's partitioned parameters, pipeline x ZeRO-1
    for strategy, world, key, sizes in (("zero3", 1, "none", {}), ("zero1", 4, "pp", {"pp": 2})):
        mode, why = _mode(_state("ddp", 2), strategy, world, key, **sizes)
        assert mode is None and "cannot load a resharded state" in why and "ddp x 2 processes" in why
