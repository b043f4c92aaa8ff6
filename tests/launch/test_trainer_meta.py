"""No one-time stall inside the training loop: run metadata is gathered before the first step.

    python -m pytest -q tests/launch/test_trainer_meta.py

The sft recipe runs 3 steps on one process, with a checkpoint after step 2, with spies on
hfpar.observe.metrics.library_versions and Trainer._train_step; the loop (first step's start to last step's end) must
import nothing new outside torch (importing deepspeed for its version once cost the first logged step ~0.5 s, and
Accelerate's unwrap_model imported it at the first checkpoint save).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import ROOT, env

DRIVER = r"""
import json, sys, time
from hfpar import recipe
from hfpar.observe import metrics
from hfpar.train import trainer

events, loop = [], {}

def spy(name, fn):
    def wrapped(*a, **kw):
        if name == "step" and "start" not in loop:
            loop["start"] = set(sys.modules)
        events.append(name)
        out = fn(*a, **kw)
        loop["end"] = set(sys.modules)
        return out
    return wrapped

metrics.library_versions = spy("versions", metrics.library_versions)
trainer.Trainer._train_step = spy("step", trainer.Trainer._train_step)
recipe.main("sft", sys.argv[1:])
new = sorted(m for m in loop["end"] - loop["start"] if not m.startswith("torch"))
print("META " + json.dumps({"events": events, "imported_in_loop": new, "deepspeed_imported": "deepspeed" in sys.modules}))
"""  # noqa: E501  (DRIVER is the subprocess's code: kept byte for byte)


def test_run_metadata_is_gathered_before_the_first_step(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER,
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--eval_steps",
            "0",
            "--save_final_model",
            "false",
            "--logging_steps",
            "1",
            "--save_steps",
            "2",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(next(line[5:] for line in proc.stdout.splitlines() if line.startswith("META ")))
    assert meta["events"] == ["versions", "step", "step", "step"], meta["events"]  # once, before the loop
    assert meta["imported_in_loop"] == [], meta["imported_in_loop"]
    info = json.loads((out / "run_info.json").read_text())
    assert info["optimizer"] == "fused" and info["versions"]["torch"] and "deepspeed" in info["versions"]
    try:
        import importlib.metadata

        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = None
    # deepspeed's version is recorded without importing it (a single-process run never needs it)
    assert info["versions"]["deepspeed"] == ds_version and not meta["deepspeed_imported"]
