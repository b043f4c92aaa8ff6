"""Tensor parallelism over every causal-LM model type transformers ships: a tiny model of each, TP=2 against the
unsharded model (tests/helpers/tp_sweep.py: loss and every gradient, one SGD step, again; float64, within 1e-4).

    python benchmarks/tp_family_sweep.py                      # all types -> benchmarks/results/tp_family_sweep.json
    python benchmarks/tp_family_sweep.py olmo2 falcon         # some types, printed only
    TP_SWEEP_FP32=1 python benchmarks/tp_family_sweep.py ...  # in float32
    TP_SWEEP_SP=1 python benchmarks/tp_family_sweep.py ...    # with sequence parallelism (all types: its own JSON)

Counts: exact / refused (one line naming the module or entry) / mismatched / skipped (with the reason), the share
exact among those in scope (exact + refused + mismatched), how many of the exact ones have their decoder blocks
sharded (an attention / MLP projection tensor-parallel, not only the embedding and the LM head: "blocks_sharded")
and the wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.dist import run_distributed
from tests.helpers.tp_sweep import TOL, sweep_worker

OUT = ROOT / "benchmarks" / "results" / ("tp_family_sweep_sp.json" if os.environ.get("TP_SWEEP_SP") else
                                          "tp_family_sweep.json")


def main(argv: list[str]) -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.perf_counter()
    res = run_distributed(sweep_worker, 2, types, True, timeout=7200)[0]
    wall = time.perf_counter() - t0
    counts = {s: sum(r["status"] == s for r in res.values()) for s in ("exact", "refused", "mismatched", "skipped")}
    tested = counts["exact"] + counts["refused"] + counts["mismatched"]
    blocks = sum(r["status"] == "exact" and bool(r.get("blocks_sharded")) for r in res.values())
    summary = {"counts": counts, "in_scope": tested, "exact_share": round(counts["exact"] / max(tested, 1), 4),
               "blocks_sharded": blocks, "blocks_sharded_share": round(blocks / max(tested, 1), 4),
               "wall_s": round(wall, 1), "tol": TOL, "results": res}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if not argv:
        OUT.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
