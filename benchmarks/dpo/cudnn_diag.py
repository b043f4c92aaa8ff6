"""GPU diagnosis of the DPO step's time: per-step wall of hfpar's recipe on the GPU case of benchmarks/dpo/speed.py,
with SDPA's default kernels and with cuDNN attention off.

    python -m benchmarks.dpo.cudnn_diag default nocudnn      # one CUDA GPU; DIAG_OPTS='{"steps": 10}' overrides sizes

Run once on an H200 (2026-11-26, the dpo branch at a82377f, before the trainer chose the kernels itself):
benchmarks/results/dpo/logs/cudnn_diag.log. It found the 2.3-3.9 s steps at new row shapes (cuDNN attention builds a
plan per shape) that hfpar.train.trainer.attention_kernels now avoids (since then "default" means without cuDNN).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.launch import module_cmd
from benchmarks.dpo import speed as B
from benchmarks.dpo.trl_compare import make_case, run_hfpar
from hfpar.train.trainer import Trainer


def child(model: str, data: str, opts: dict, variant: str) -> None:
    """One run of the recipe in this process; prints its per-step wall times (ms)."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    if variant == "nocudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    wall = []
    step = Trainer._train_step

    def timed(self, i, loaded, t0, c0):  # t0: when the loop asked for the step's batches (waiting counts)
        r = step(self, i, loaded, t0, c0)
        sync()
        wall.append(round((time.perf_counter() - t0) * 1000, 1))
        return r

    Trainer._train_step = timed
    run_hfpar(model, data, tempfile.mkdtemp(), steps=opts["steps"], batch=opts["batch"], max_length=opts["max_length"])
    print("RESULT", variant, "ms/step", wall, "median", sorted(wall)[len(wall) // 2], "sum[1:]", round(sum(wall[1:])))


def main() -> None:
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5])
        return
    o = dict(B.GPU, **json.loads(os.environ.get("DIAG_OPTS", "{}")))
    config = B.model_config(o["hidden"], o["layers"], o["vocab"], o["seq"])
    opts = {"steps": o["steps"], "batch": o["batch"], "max_length": 2 * o["seq"]}
    root, n = Path(tempfile.mkdtemp()), o["steps"] * o["batch"]
    model, data = make_case(root, pairs=n, config_updates=config, rows=B.long_pairs(n, o["seq"], o["prompt_len"]))
    for v in sys.argv[1:]:
        p = subprocess.run(
            module_cmd("benchmarks.dpo.cudnn_diag", "child", model, data, json.dumps(opts), v),
            capture_output=True,
            text=True,
            check=False,
        )
        print([x for x in p.stdout.splitlines() if x.startswith("RESULT")] or p.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
