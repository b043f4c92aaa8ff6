"""Strategy knowledge lives in hfpar/backends/ only, and hfpar/parallel/ is a standalone library.

    python -m pytest -q tests/unit/test_strategy_knowledge.py

Outside hfpar/backends/ no module compares a strategy's name (==, !=, in, startswith): it reads the attributes of
ctx.strategy (hfpar.backends.strategies) instead; the same pattern as the project's pre-stop hook. hfpar/parallel/
takes numbers and groups, never RecipeArgs (no `args.` reads), and imports nothing else of hfpar.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

HFPAR = Path(__file__).resolve().parents[2] / "hfpar"
NAME_COMPARISON = re.compile(
    r"""(==|!=| in )\s*\(?\s*["'](single|ddp|fsdp1|fsdp2|zero1|zero2|zero3)["']"""
    r"""|startswith\(["'](zero|fsdp)"""
)


def _modules(under: Path):
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_strategy_name_comparison_outside_backends():
    backends = HFPAR / "backends"
    hits = [
        f"{p.relative_to(HFPAR.parent)}:{i}: {line.strip()}"
        for p in _modules(HFPAR)
        if backends not in p.parents
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if NAME_COMPARISON.search(line)
    ]
    assert not hits, "strategy names compared outside hfpar/backends/ (read ctx.strategy's attributes):\n" + "\n".join(
        hits
    )


def _imported(tree: ast.AST, path: Path) -> list[str]:
    """Absolute names of every module a file imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(HFPAR.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module or "")
    return out


def test_parallel_is_a_standalone_library():
    problems = []
    for p in _modules(HFPAR / "parallel"):
        text = p.read_text()
        rel = p.relative_to(HFPAR.parent)
        for name in _imported(ast.parse(text), p):
            if name == "hfpar" or (name.startswith("hfpar.") and not name.startswith("hfpar.parallel")):
                problems.append(f"{rel}: imports {name}")
        if "RecipeArgs" in text:
            problems.append(f"{rel}: mentions RecipeArgs")
        problems += [
            f"{rel}:{i}: reads args.{m.group(1)}"
            for i, line in enumerate(text.splitlines(), 1)
            for m in re.finditer(r"\bargs\.([A-Za-z_]\w*)", line)
        ]
    assert not problems, "hfpar/parallel/ must take numbers and groups, never RecipeArgs:\n" + "\n".join(problems)
