"""Expert parallelism over every MoE causal-LM model type transformers ships: a tiny model of each, EP=2 against the
unsharded model (tests/helpers/ep_sweep.py: loss and every gradient, one SGD step, again; float32, within 1e-4).

    python benchmarks/ep_family_sweep.py                      # all types -> benchmarks/results/ep_family_sweep.json
    python benchmarks/ep_family_sweep.py olmo2 falcon         # some types, printed only
    EP_SWEEP_FP64=1 python benchmarks/ep_family_sweep.py ...  # in float64

Counts: exact / refused (one line naming the module and what differs) / mismatched / skipped (with the reason) / dense
(no MoE block, out of scope), the share exact among the MoE families in scope (exact + refused + mismatched) and the
wall time.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.dist import run_distributed
from tests.helpers.ep_sweep import DTYPE, TOL, sweep_worker

OUT = ROOT / "benchmarks" / "results" / "ep_family_sweep.json"


def main(argv: list[str]) -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    t0 = time.perf_counter()
    res = run_distributed(sweep_worker, 2, types, True, timeout=7200)[0]
    wall = time.perf_counter() - t0
    counts = {s: sum(r["status"] == s for r in res.values()) for s in ("exact", "refused", "mismatched", "skipped", "dense")}
    tested = counts["exact"] + counts["refused"] + counts["mismatched"]
    summary = {"counts": counts, "in_scope": tested, "exact_share": round(counts["exact"] / max(tested, 1), 4),
               "wall_s": round(wall, 1), "tol": TOL, "dtype": str(DTYPE), "results": res}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if not argv:
        OUT.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
