"""docs/tensor-parallel.md's "Families by coverage" section is the one benchmarks/tensor_parallel/families_doc.py
generates from plans.py (and the sweep's JSON when present): regenerate it with `python -m
benchmarks.tensor_parallel.families_doc`."""

from __future__ import annotations

from pathlib import Path

from benchmarks.tensor_parallel import families_doc as mod

ROOT = Path(__file__).resolve().parents[2]


def test_families_section_is_generated_from_the_code():
    assert mod.section() in (ROOT / "docs" / "tensor-parallel.md").read_text(), (
        "stale: run python -m benchmarks.tensor_parallel.families_doc"
    )
