"""The backend support matrix (hfpar.backends.SUPPORT) as data: complete, selected and refused as documented.

    python -m pytest tests/unit/test_backends_matrix.py -q

Every (strategy, parallelism) pair of STRATEGIES x PARALLELISMS has an entry; the supported pairs are exactly
the ones the parity suites launch (written out below); select_backend returns their class and refuses every
other pair with a one-line ConfigError naming the flag, the strategy and where the parallelism composes; the
README shows support_table_markdown() verbatim.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest

from hfpar.backends import (
    PARALLELISMS,
    STRATEGIES,
    SUPPORT,
    AccelerateBackend,
    ModelParallelDDP,
    ModelParallelDeepSpeed,
    ModelParallelFSDP2,
    ModelParallelZeRO3,
    PipelineDDP,
    PipelineFSDP2,
    PipelineZeRO1,
    select_backend,
    support_table_markdown,
)
from hfpar.config import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"
_MP = {
    "single": ModelParallelDDP,
    "ddp": ModelParallelDDP,
    "fsdp2": ModelParallelFSDP2,
    "zero1": ModelParallelDeepSpeed,
    "zero2": ModelParallelDeepSpeed,
    "zero3": ModelParallelZeRO3,
}
# what the parity suites launch: test_backends_parity (none), test_tp_parity (tp), test_ep_parity (ep, tp+ep),
# test_cp_parity (cp, tp+cp), test_pp_parity (pp, tp+pp, ep+pp, cp+pp; its extended tier tp+ep+pp, tp+cp+pp,
# ep+cp+pp, tp+ep+cp+pp), test_ep_parity's EP x CP cases (ep+cp, tp+ep+cp)
SUPPORTED = {
    **{(s, "none"): AccelerateBackend for s in STRATEGIES},
    **{(s, "tp"): cls for s, cls in _MP.items()},
    **{(s, "ep"): cls for s, cls in _MP.items()},
    **{(s, "cp"): AccelerateBackend for s in STRATEGIES if s != "fsdp1"},
    **{(s, "tp+cp"): cls for s, cls in _MP.items()},
    **{(s, "tp+ep"): cls for s, cls in _MP.items()},
    **{(s, "ep+cp"): cls for s, cls in _MP.items()},
    **{(s, "tp+ep+cp"): cls for s, cls in _MP.items()},
    ("single", "pp"): PipelineDDP,
    ("ddp", "pp"): PipelineDDP,
    ("fsdp2", "pp"): PipelineFSDP2,
    ("zero1", "pp"): PipelineZeRO1,
    ("single", "tp+pp"): PipelineDDP,
    ("ddp", "tp+pp"): PipelineDDP,
    ("fsdp2", "tp+pp"): PipelineFSDP2,
    ("zero1", "tp+pp"): PipelineZeRO1,
    ("single", "ep+pp"): PipelineDDP,
    ("ddp", "ep+pp"): PipelineDDP,
    ("fsdp2", "ep+pp"): PipelineFSDP2,
    ("zero1", "ep+pp"): PipelineZeRO1,
    ("single", "cp+pp"): PipelineDDP,
    ("ddp", "cp+pp"): PipelineDDP,
    ("fsdp2", "cp+pp"): PipelineFSDP2,
    ("zero1", "cp+pp"): PipelineZeRO1,
    **{
        (s, k): cls
        for k in ("tp+ep+pp", "tp+cp+pp", "ep+cp+pp", "tp+ep+cp+pp")
        for s, cls in (
            ("single", PipelineDDP),
            ("ddp", PipelineDDP),
            ("fsdp2", PipelineFSDP2),
            ("zero1", PipelineZeRO1),
        )
    },
}
PARTS = {
    "none": (),
    "tp": ("tp",),
    "ep": ("ep",),
    "tp+ep": ("tp", "ep"),
    "cp": ("cp",),
    "tp+cp": ("tp", "cp"),
    "ep+cp": ("ep", "cp"),
    "tp+ep+cp": ("tp", "ep", "cp"),
    "pp": ("pp",),
    "tp+pp": ("tp", "pp"),
    "ep+pp": ("ep", "pp"),
    "cp+pp": ("cp", "pp"),
    "tp+ep+pp": ("tp", "ep", "pp"),
    "tp+cp+pp": ("tp", "cp", "pp"),
    "ep+cp+pp": ("ep", "cp", "pp"),
    "tp+ep+cp+pp": ("tp", "ep", "cp", "pp"),
}
SIZES = {"tp": 2, "ep": 4, "cp": 2, "pp": 2}
# refused pair -> text its message must contain (besides the flag and the strategy)
REFUSED = {
    ("fsdp1", "tp"): [
        "tensor parallelism composes with single, ddp, fsdp2, zero1, zero2 and zero3 configs",
        "FSDP1 is not supported",
    ],
    ("fsdp1", "ep"): [
        "expert parallelism composes with single, ddp, fsdp2, zero1, zero2 and zero3 configs",
        "FSDP1 is not supported",
    ],
    ("fsdp1", "cp"): ["context parallelism composes with", "FSDP1 is not supported"],
    ("fsdp1", "tp+cp"): ["FSDP1 is not supported"],
    ("fsdp1", "tp+ep"): ["FSDP1 is not supported"],
    ("fsdp1", "ep+cp"): ["FSDP1 is not supported"],
    ("fsdp1", "tp+ep+cp"): ["FSDP1 is not supported"],
    ("fsdp1", "pp"): [
        "pipeline parallelism composes with single, ddp, fsdp2 and zero1 configs",
        "FSDP1 is not supported",
    ],
    **{
        (s, "pp"): [
            "pipeline parallelism composes with single, ddp, fsdp2 and zero1 configs",
            "DeepSpeed refuses them with its own pipeline",
            "use zero1.yaml",
        ]
        for s in ("zero2", "zero3")
    },
    ("fsdp1", "tp+pp"): ["FSDP1 is not supported"],
    ("fsdp1", "ep+pp"): ["FSDP1 is not supported"],
    ("fsdp1", "cp+pp"): ["FSDP1 is not supported"],
    **{
        (s, k): ["DeepSpeed refuses them with its own pipeline", "use zero1.yaml"]
        for s in ("zero2", "zero3")
        for k in ("tp+pp", "ep+pp", "cp+pp", "tp+ep+pp", "tp+cp+pp", "ep+cp+pp", "tp+ep+cp+pp")
    },
    **{("fsdp1", k): ["FSDP1 is not supported"] for k in ("tp+ep+pp", "tp+cp+pp", "ep+cp+pp", "tp+ep+cp+pp")},
}


def test_every_pair_has_an_entry():
    keys = set(product(STRATEGIES, PARALLELISMS))
    assert set(SUPPORT) == keys, (sorted(keys - set(SUPPORT)), sorted(set(SUPPORT) - keys))
    assert all(isinstance(v, type) or (isinstance(v, str) and v and "\n" not in v) for v in SUPPORT.values())


def test_supported_pairs_are_exactly_the_launched_ones():
    supported = {k: v for k, v in SUPPORT.items() if isinstance(v, type)}
    assert supported == SUPPORTED
    assert set(SUPPORT) - set(SUPPORTED) == set(REFUSED)


@pytest.mark.parametrize("pair", sorted(SUPPORTED), ids="-".join)
def test_select_backend_returns_the_class(pair):
    strategy, key = pair
    sizes = {p: SIZES[p] for p in PARTS[key]}
    assert select_backend(strategy, PARTS[key], sizes) is SUPPORTED[pair]
    assert select_backend(strategy, PARTS[key]) is SUPPORTED[pair]  # sizes are for messages


@pytest.mark.parametrize("pair", sorted(REFUSED), ids="-".join)
def test_select_backend_refuses_with_one_line(pair):
    strategy, key = pair
    parts = PARTS[key]
    with pytest.raises(ConfigError) as e:
        select_backend(strategy, parts, {p: SIZES[p] for p in parts})
    msg = str(e.value)
    assert "\n" not in msg, msg
    flags = " and ".join(f"--{p}_size {SIZES[p]}" for p in parts)
    assert msg.startswith(f"{flags} with {strategy}: "), msg
    for s in REFUSED[pair]:
        assert s in msg, (s, msg)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_support_table_rows():
    lines = support_table_markdown().splitlines()
    cols = [s for s in STRATEGIES if s != "fsdp1"]
    assert lines[0] == "| parallelism | " + " | ".join(cols) + " |"
    assert [ln.split(" | ")[0].lstrip("| ") for ln in lines[2:]] == list(PARALLELISMS)
    for ln, key in zip(lines[2:], PARALLELISMS):
        cells = [c.strip() for c in ln.strip("|").split("|")][1:]
        assert len(cells) == len(cols), ln
        for s, cell in zip(cols, cells):
            want = SUPPORTED.get((s, key))
            assert cell == (f"yes ({want.short})" if want else "no"), (s, key, cell)


def test_readme_shows_the_support_table():
    table = support_table_markdown()
    assert table in README.read_text(), f"README.md does not contain support_table_markdown() verbatim:\n{table}"
