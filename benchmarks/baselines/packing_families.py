"""Which of transformers' causal-LM model types train on padding-free rows: hfpar.data.packing_probe on each type's
default config (the recipe runs it on the run's own config), with its default attention.

    python -m benchmarks.baselines.packing_families        # ~2 minutes on 2 CPU cores -> results/baselines/packing_*

Outcomes: apart (padding-free rows apply), mixed (a packed sample's logits move when another sample changes, or
differ from the sample alone) and not checked (the tiny copy could not be built or run, is still too large, or is
custom code): both of the last two keep padded rows. Writes packing_families.json (type -> reason or null) and
packing_families.md (counts and the types of each outcome).
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
from hfpar.data.packing_probe import packing_problem


def outcome(why: str | None) -> str:
    if why is None:
        return "apart"
    return "mixed" if "see each other" in why or "differ from the sample" in why else "not checked"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for packing_families.{json,md} (default: results/baselines)")
    p.add_argument("model_types", nargs="*", help="some types only (default: all)")
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    types = a.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    answers, t0 = {}, time.time()
    for mt in tqdm(types, desc="packing check"):
        try:
            answers[mt] = packing_problem(AutoConfig.for_model(mt))
        except Exception as e:  # noqa: BLE001 - a config the family cannot build with its own defaults
            answers[mt] = f"its default config could not be built ({type(e).__name__})"
    groups = defaultdict(list)
    for mt, why in answers.items():
        groups[outcome(why)].append(mt)
    out = Path(a.out) if a.out else results_dir("baselines")
    title = "# Padding-free rows by model type (hfpar.data.packing_probe)"
    lines = write_report(out, "packing_families", title, t0, answers, groups, ("apart", "mixed", "not checked"))
    print("\n".join(lines[:9]))


if __name__ == "__main__":
    main()
