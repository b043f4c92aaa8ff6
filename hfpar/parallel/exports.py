"""Public names of a package imported from their submodule on first use (PEP 562), as transformers' _LazyModule.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {".apply": ("apply_tensor_parallel", ...), ...})

Why: a package __init__ that imports every submodule makes `from hfpar.parallel.expert_parallel import
upcycle_problem` pay for the MoE layers, and those pull in transformers' modeling code (with torchao, when installed),
torch._dynamo and DTensor: about 3 s per process. The recipes' preflight reads such one-function modules only, so a
refusal ends before any of that is imported (tests/launch/test_preflight.py::test_a_refusal_imports_no_layers).
Here, in the standalone library, for its packages; hfpar, hfpar.data, hfpar.loading and hfpar.train use it too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping


def lazy_exports(package: str, table: Mapping[str, Iterable[str]]) -> tuple[Callable, Callable, list[str]]:
    """-> (__getattr__, __dir__, __all__) for the package `package`; table: submodule (relative or absolute) -> the
    names it provides (those starting with "_" are left out of __all__)."""
    where = {name: sub for sub, names in table.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(sys.modules[package], name, value)  # resolved once: later lookups are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__, sorted(n for n in where if not n.startswith("_"))
