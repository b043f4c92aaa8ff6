"""Which of transformers' causal-LM model types context parallelism accepts, by the preflight's three checks on each
type's default config (with the fields a checkpoint has and its defaults lack: the TP family sweep's FAMILY_KW): the
meta-device probe of the attention (hfpar.parallel.context_parallel.probe: every attention through transformers'
registry, nothing it cannot honour; the tiny copy where meta cannot run it), the token-mixing check of the tiny copy
(hfpar.parallel.context_parallel.mixing: what else mixes tokens, run on the whole rows: "accepted" names those
classes; refused where one cannot be) and the tiny copy cut over emulated cp ranks
(hfpar.parallel.context_parallel.shard_check: it computes what it computes whole).

    python -m benchmarks.context_parallel.families     # ~4 minutes on 2 CPU cores -> results/context_parallel/

Outcomes: accepted; refused by the attention probe; refused by the token-mixing check or the cut-rows check (a
module named), or not checked (its tiny copy could not be built or run). Writes families.json (type -> the
reasons) and families.md (counts and the types).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from benchmarks.common.family_report import write_report
from benchmarks.common.launch import results_dir
from benchmarks.tensor_parallel.family_sweep import FAMILY_KW
from hfpar.parallel.context_parallel.mixing import token_mixers
from hfpar.parallel.context_parallel.probe import cp_attention_problems
from hfpar.parallel.context_parallel.shard_check import shard_problem

OUTCOMES = (
    "accepted",
    "refused: attention",
    "refused: token mixing",
    "refused: cut rows differ",
    "refused: not checked",
)


def verdict(config) -> tuple[str, list[str]]:
    """(outcome, reasons) for one config, as the preflight decides (the mixing check only where the probe passes)."""
    if problems := cp_attention_problems(config):
        return "refused: attention", problems
    mixers, why = token_mixers(config)
    if why:
        return ("refused: not checked" if "could not be checked" in why else "refused: token mixing"), [why]
    if why := shard_problem(config):
        return ("refused: not checked" if "could not be checked" in why else "refused: cut rows differ"), [why]
    return "accepted", [f"on whole rows: {c.rsplit('.', 1)[-1]}" for c in mixers]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for families.{json,md} (default: results/context_parallel)")
    p.add_argument("model_types", nargs="*", help="some types only (default: all)")
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    answers, groups, t0 = {}, defaultdict(list), time.time()
    for mt in tqdm(a.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), desc="cp check"):
        try:
            config = AutoConfig.for_model(mt, **FAMILY_KW.get(mt, {}))  # fields its defaults lack (as a checkpoint)
        except Exception as e:  # noqa: BLE001 - a config the family cannot build with its own defaults
            answers[mt] = {"outcome": "skipped", "why": [f"its default config could not be built ({type(e).__name__})"]}
            continue
        outcome, why = verdict(config)
        answers[mt] = {"outcome": outcome, "why": why}
        groups[outcome].append(mt)
    out = Path(a.out) if a.out else results_dir("context_parallel")
    title = "# Context parallelism by model type (the preflight's attention probe, token-mixing and cut-rows checks)"
    lines = write_report(out, "families", title, t0, answers, groups, OUTCOMES)
    print("\n".join(lines[:10]))


if __name__ == "__main__":
    main()
