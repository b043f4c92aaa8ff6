"""Bounded reads of the JSON files of an untrusted directory: size and nesting checked before parsing, one line.

data, problem = read_json(Path("model/config.json"))   # (parsed, None) or (None, "…: not valid JSON (…)")
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_CONFIG_BYTES = 16 << 20  # a config is kilobytes; 16 MiB leaves room for huge vocab maps
MAX_JSON_DEPTH = 64  # real configs nest a few levels; deep nesting exhausts recursive parsers


def json_depth(text: str) -> int:
    """The deepest nesting of [ / { in a JSON text (strings skipped), without parsing it."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def read_json(path: Path, limit: int = MAX_CONFIG_BYTES) -> tuple[object, str | None]:
    """(parsed, None) or (None, one line): size bounded, nesting bounded, syntax checked."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return None, f"{path}: unreadable ({exc.strerror})"
    if size > limit:
        return None, f"{path}: {size:,} bytes, over the {limit:,} hfpar reads for such a file"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: unreadable ({type(exc).__name__})"
    if json_depth(text) > MAX_JSON_DEPTH:
        return None, f"{path}: nested deeper than {MAX_JSON_DEPTH} levels, not a file transformers writes"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"{path}: not valid JSON ({str(exc).splitlines()[0]})"
