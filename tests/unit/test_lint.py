"""The tree is formatted and linted by ruff with the project's settings (pyproject.toml [tool.ruff]: line length 120,
pycodestyle, pyflakes, import order, pyupgrade).

    ruff format . && ruff check --fix .     # what to run before committing
    python -m pytest -q tests/unit/test_lint.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (it is in the test extras)")
    return [exe]


@pytest.mark.parametrize(
    "command",
    [["check", "--no-fix", "--no-cache", "."], ["format", "--check", "--no-cache", "."]],
    ids=["check", "format"],
)
def test_ruff_passes(command):
    # --no-cache: the suite writes nothing into the checkout
    proc = subprocess.run([*_ruff(), *command], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
