"""docs/tensor-parallel.md's "Families by coverage" section is the one benchmarks/tp_families_doc.py generates from
plans.py (and the sweep's JSON when present): regenerate it with `python benchmarks/tp_families_doc.py`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_families_section_is_generated_from_the_code():
    spec = importlib.util.spec_from_file_location("tp_families_doc", ROOT / "benchmarks" / "tp_families_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.section() in (ROOT / "docs" / "tensor-parallel.md").read_text(), \
        "stale: run python benchmarks/tp_families_doc.py"
