"""Writes the "Families by coverage" section of docs/tensor-parallel.md from the code (plans.py's lists) and, when
present, the family sweep's result (benchmarks/results/tensor_parallel/family_sweep.json, written by family_sweep.py).

    python -m benchmarks.tensor_parallel.families_doc          # rewrites the section between its two markers
"""

from __future__ import annotations

import json

from benchmarks.common.launch import RESULTS, ROOT
from hfpar.parallel.tensor_parallel.plans import (
    TESTED_DERIVED_MODEL_TYPES,
    TESTED_INFERRED_MODEL_TYPES,
    TESTED_MODEL_TYPES,
    TP_PLANS,
)

DOC = ROOT / "docs" / "tensor-parallel.md"
SWEEP = RESULTS / "tensor_parallel" / "family_sweep.json"
START, END = "<!-- tp-families:start (benchmarks/tensor_parallel/families_doc.py) -->", "<!-- tp-families:end -->"


def section() -> str:
    rows = [
        ("written plan (plans.py), parity-tested", sorted(TESTED_MODEL_TYPES)),
        ("written plan, untested", sorted(set(TP_PLANS) - set(TESTED_MODEL_TYPES))),
        ("derived from base_model_tp_plan, parity-tested", sorted(TESTED_DERIVED_MODEL_TYPES)),
        ("inferred from the modules, parity-tested", sorted(TESTED_INFERRED_MODEL_TYPES)),
    ]
    lines = [START, "", "| coverage | model types |", "| --- | --- |"]
    lines += [f"| {what} | {', '.join(f'`{t}`' for t in types) or '-'} |" for what, types in rows]
    if SWEEP.exists():
        res = json.loads(SWEEP.read_text())
        by = {}
        for mt, r in sorted(res["results"].items()):
            by.setdefault(r["status"], []).append(mt)
        lines += [
            f"| sweep: {s} ({len(by.get(s, []))}) | {', '.join(f'`{t}`' for t in by.get(s, [])) or '-'} |"
            for s in ("exact", "refused", "mismatched")
        ]
        flat = [mt for mt in by.get("exact", []) if res["results"][mt].get("blocks_sharded") is False]
        lines += [
            f"| of those exact, only the embedding and LM head sharded, blocks replicated ({len(flat)}) | "
            f"{', '.join(f'`{t}`' for t in flat) or '-'} |"
        ]
        blocks = len(by.get("exact", [])) - len(flat)
        lines += [
            "",
            (
                "Sweep (benchmarks/tensor_parallel/family_sweep.py, TP=2 vs unsharded, loss and every gradient before "
                "and "
                f"after one SGD step within {res['tol']:g}): {res['counts']['exact']} of {res['in_scope']} "
                f"in-scope types exact, {blocks} of {res['in_scope']} with their decoder blocks sharded "
                f"(attention and / or MLP projections tensor-parallel, not only the embedding and the LM head), "
                f"{res['counts']['mismatched']} mismatched ({res['counts']['skipped']} skipped with their "
                f"reason in the JSON; wall time {res['wall_s']:.0f} s, "
                f"{res.get('run', 'one run on a shared 2-core machine')})."
            ),
        ]
        if by.get("refused"):
            lines += ["", "Refused, each in its one line:", ""]
            lines += [f"- `{mt}`: {res['results'][mt]['why']}" for mt in by["refused"]]
    else:
        lines += [
            "",
            (
                "Every other family: a plan derived from its `base_model_tp_plan` or inferred from its modules, "
                "verified on its first block at apply time (or refused in one line)."
            ),
        ]
    return "\n".join(lines + ["", END])


def main() -> None:
    text = DOC.read_text()
    a, b = text.index(START), text.index(END) + len(END)
    DOC.write_text(text[:a] + section() + text[b:])


if __name__ == "__main__":
    main()
