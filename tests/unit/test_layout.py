"""The package's shape, checked from source (no imports run): what a newcomer walking the tree relies on.

    python -m pytest -q tests/unit/test_layout.py

- at the root of hfpar/ only the entry points, each named in the README's code map;
- no import cycle between hfpar's modules, nor between its folders (imports inside functions counted too:
  hiding one there breaks no cycle of design; relative ones resolved);
- an import of hfpar's own modules inside a function says why in a comment (start-up cost measured);
- hfpar/parallel/ is the standalone library: it imports nothing else of hfpar.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hfpar"
ENTRY_POINTS = {
    "__init__.py",
    "cli.py",
    "recipe.py",
    "config.py",
    "context.py",
    "preflight.py",
    "parallelize.py",
    "distributed.py",
    "launch.py",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, path: Path, modules: dict, *, in_functions: bool) -> list[tuple[str, int]]:
    """(imported hfpar module, line) for the module-level imports (or those inside functions)."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn) if n is not fn}
    found = []
    for node in ast.walk(tree):
        if (id(node) in inside) != in_functions:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("hfpar")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, path, node)
            if not target.startswith("hfpar"):
                continue
            for a in node.names:  # `from hfpar.x import y`: y may be a module itself
                sub = f"{target}.{a.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return [(m, line) for m, line in found if m in modules]


def test_only_entry_points_at_the_root_and_each_in_the_code_map():
    root_files = {p.name for p in PKG.glob("*.py")}
    assert root_files == ENTRY_POINTS, f"move these into a folder by concern: {sorted(root_files - ENTRY_POINTS)}"
    readme = (ROOT / "README.md").read_text()
    missing = [f for f in sorted(ENTRY_POINTS - {"__init__.py"}) if f not in readme]
    assert not missing, f"README's code map does not name {missing}"


# A cycle another change of issue 38 removes (the recipe restructure: train/dpo.py <-> train/dpo_setup.py); when it
# lands, empty this set and the test holds every cycle again.
BEING_REMOVED: set[tuple[str, ...]] = set()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: any component of more than one node is a cycle."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            # a package __init__ importing its own submodules is not a cycle unless a submodule imports it back
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def _graph(modules: dict, node=lambda m: m) -> dict[str, set[str]]:
    """node(importer) -> node(imported) for every import of hfpar, at module level or inside a function."""
    graph: dict[str, set[str]] = {node(m): set() for m in modules}
    for m, p in modules.items():
        for inf in (False, True):
            graph[node(m)] |= {node(t) for t, _ in _imports(m, p, modules, in_functions=inf) if node(t) != node(m)}
    return graph


def _folder(module: str) -> str:
    """hfpar.train.trainer -> hfpar.train; an entry point at the root stays itself; the package root `hfpar` (its
    lazy __init__ names the public API) is left out."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle():
    cycles = [c for c in _cycles(_graph(_modules())) if tuple(c) not in BEING_REMOVED]
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycle_between_folders():
    """The layers read top-down: entry points, then train/, then what it builds on (backends/, checkpoint/, ...),
    the standalone library parallel/ at the bottom; no folder imports one that imports it back."""
    graph = _graph({m: p for m, p in _modules().items() if m != "hfpar"}, _folder)
    graph = {a: {b for b in bs if b != "hfpar"} for a, bs in graph.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between folders: {cycles}"


def test_in_function_imports_of_hfpar_say_why():
    modules = _modules()
    unexplained = []
    for mod, path in modules.items():
        lines = path.read_text().splitlines()
        for _, lineno in _imports(mod, path, modules, in_functions=True):
            # the reason: a comment on the import line (after any noqa) or on the line(s) just above it
            near = [lines[lineno - 1]] + lines[max(0, lineno - 4) : lineno - 1]
            reason = [re.sub(r"noqa: ?[A-Z0-9, ]+", "", x.split("#", 1)[1]).strip() for x in near if "#" in x]
            if not any(len(r) > 8 for r in reason):
                unexplained.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not unexplained, f"in-function imports of hfpar without a reason comment: {unexplained}"


def test_parallel_is_standalone():
    modules = _modules()
    leaks = [
        f"{p.relative_to(ROOT)}:{line} imports {t}"
        for m, p in modules.items()
        if m == "hfpar.parallel" or m.startswith("hfpar.parallel.")
        for inf in (False, True)
        for t, line in _imports(m, p, modules, in_functions=inf)
        if not (t == "hfpar.parallel" or t.startswith("hfpar.parallel."))
    ]
    assert not leaks, leaks


def test_the_trainer_is_never_called_back():
    """The trainer calls the Checkpointer and the RunRecorder; they (and everything under checkpoint/ and observe/)
    never import the training loop, so one run reads top-down."""
    modules = _modules()
    back = [
        f"{p.relative_to(ROOT)}:{line} imports {t}"
        for m, p in modules.items()
        if m.startswith(("hfpar.checkpoint", "hfpar.observe"))
        for inf in (False, True)
        for t, line in _imports(m, p, modules, in_functions=inf)
        if t.startswith("hfpar.train")
    ]
    assert not back, back
    trainer = (PKG / "train" / "trainer.py").read_text()
    assert "Checkpointer(" in trainer and "RunRecorder(" in trainer
