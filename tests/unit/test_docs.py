"""The README and the docs site: size, links, the mkdocs build and nav, and the code map.

    python -m pytest -q tests/unit/test_docs.py

README.md stays a newcomer's first read (at most 16 KB); the rest lives in docs/*.md, built with mkdocs
(mkdocs.yml at the repository root, docs_dir docs/). Links are written relative to the file that holds them, so
that they work on GitHub: README -> docs/<page>.md, a page -> ../benchmarks/... . mkdocs cannot resolve the
links that leave docs/ (it reports them as info), so this file checks that every relative link of README.md and
docs/*.md points at an existing file, and the anchors of links into README.md and between pages.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_BYTES = 16384

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
# repository paths and dotted hfpar names the prose mentions (checked to exist, so moves do not leave stale names)
REPO_PATH = re.compile(
    r"(?<![\w./$-])((?:hfpar|tests|benchmarks|recipes|examples|scripts|accelerate_configs|docs)"
    r"/[\w./-]*\w)(?:\.\{([\w,]+)\})?"
)  # results/x.{json,md}: each suffix
DOTTED = re.compile(r"(?<![\w./-])hfpar(?:\.\w+)+")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def markdown_files() -> list[Path]:
    return [README, *pages()]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands there are examples, not links)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's (and python-markdown toc's, for these headings) anchor of a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE.sub("", _prose(path.read_text())))]


def test_readme_is_at_most_16_kb():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes (> {MAX_README_BYTES}): move detail to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_existing_files(path):
    bad = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def _module_has(source: Path, name: str) -> bool:
    text = source.read_text()
    return (
        re.search(
            rf"(?:def|class)\s+{name}\b|^{name}\s*[:=]|^\s*{name}\s*[:=]|import[^\n]*\b{name}\b|\b{name},", text, re.M
        )
        is not None
    )


def _dotted_exists(dotted: str) -> bool:
    """hfpar.a.b[.attr...]: a package / module path under hfpar/, then names defined or imported there."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            module = here / f"{part}.py"
            return all(_module_has(module, a) for a in parts[i + 1 : 2 + i])  # one attribute level is checked
        init = here / "__init__.py"
        return init.is_file() and _module_has(init, part)
    return True


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_and_modules_exist(path):
    text = path.read_text()
    named = {f"{p}.{s}" if suffixes else p for p, suffixes in REPO_PATH.findall(text) for s in suffixes.split(",")}
    bad = sorted(p for p in named if not (ROOT / p).exists())
    bad += sorted({d for d in DOTTED.findall(text) if not _dotted_exists(d)})
    assert not bad, f"{path.relative_to(ROOT)} names paths / modules that do not exist: {bad}"


def _nav_files(nav) -> list[str]:
    out = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    assert config.get("strict") is True and config.get("docs_dir", "docs") == "docs"
    missing = [p.name for p in pages() if p.name not in nav]
    extra = [n for n in nav if not (DOCS / n).is_file()]
    assert not missing and not extra, (
        f"docs pages not in mkdocs.yml's nav: {missing}; nav entries without a page: {extra}"
    )


def test_readme_links_every_docs_page():
    linked = {Path(t.partition("#")[0]).name for t in links(README) if t.startswith("docs/")}
    missing = [p.name for p in pages() if p.name not in linked]
    assert not missing, f"README.md links no docs page {missing}"


def test_code_map_lists_exactly_the_root_modules():
    """The README's "Dive into the code" names every .py at the root of hfpar/ (only entry points live there)."""
    section = README.read_text().split("## Dive into the code", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `(\w+\.py)`", section, re.M))
    on_disk = {p.name for p in (ROOT / "hfpar").glob("*.py")}
    assert listed == on_disk, f"code map lists {sorted(listed)}, hfpar/ holds {sorted(on_disk)}"
    folders = set(re.findall(r"^- `(\w+)/`", section, re.M))
    packages = {p.name for p in (ROOT / "hfpar").iterdir() if (p / "__init__.py").is_file()}
    assert folders == packages, f"code map lists folders {sorted(folders)}, hfpar/ holds {sorted(packages)}"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' (mkdocs is in the test extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
