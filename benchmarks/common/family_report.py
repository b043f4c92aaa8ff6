"""The report of a check run over every causal-LM model type: `<stem>.json` (type -> the answer) and `<stem>.md`
(counts per outcome and the types of each), shared by benchmarks/baselines/packing_families.py and
benchmarks/context_parallel/families.py.

    write_report(out, "families", "# Title", t0, answers, groups, OUTCOMES)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common.launch import command


def write_report(
    out: Path, stem: str, title: str, t0: float, answers: dict, groups: dict, outcomes: tuple[str, ...]
) -> list[str]:
    """Write both files into `out`; returns the markdown's lines."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(answers, indent=1) + "\n")
    lines = [
        title,
        "",
        f"`{command()}`; transformers' causal-LM model types, each type's default config; {time.time() - t0:.0f} s.",
        "",
        "| outcome | types |",
        "|---|---|",
        *(f"| {k} | {len(groups[k])} |" for k in outcomes),
        "",
        *(f"**{k}**: {', '.join(groups[k]) or '-'}\n" for k in outcomes),
        f"Reasons: {stem}.json.",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines
