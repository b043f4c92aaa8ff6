"""The example loops in examples/ under torchrun match one process (the layers themselves inside HF models:
tests/distributed/test_tp_hf_loss.py, tests/distributed/test_ep_hf_semantics.py).

    python -m pytest -q -p no:cacheprovider tests/launch/test_examples.py
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers.launch import ROOT, Started, env, start_python

TOL = 1e-4  # the parity contract


def rel(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------- the example script
def _losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss (\S+)", out, flags=re.MULTILINE)]


def _run(cmd: list[str]) -> str:
    p = start_python(cmd[1:], {**env(), "PYTHONPATH": str(ROOT)})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return out


@pytest.mark.slow
def test_example_loop_matches_one_process():
    """tp 2, then dp 2 (rows split, num_items_in_batch = the global count, grads summed), vs 1 process."""
    script = str(ROOT / "examples" / "tp_accelerate_loop.py")
    ref = _losses(_run([sys.executable, script]))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for extra in ([], ["--tp_size", "1"]):
        got = _losses(_run([*torchrun, script, *extra]))
        assert len(ref) == len(got) == 6, (ref, got)
        assert max(rel(a, b) for a, b in zip(got, ref, strict=True)) < TOL, (extra, got, ref)
    assert ref[-2] < ref[0] - 0.3, ref  # it learns


def _example(nproc: int) -> Started:
    cmd = (
        [sys.executable, "examples/ep_accelerate_loop.py"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "examples/ep_accelerate_loop.py",
        ]
    )
    e = env()
    e["CUDA_VISIBLE_DEVICES"] = ""
    return start_python(cmd[1:], e)


@pytest.mark.slow
def test_accelerate_example_matches_one_process():
    procs = {n: _example(n) for n in (2, 1)}  # 3 processes at once
    losses = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        losses[n] = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, re.MULTILINE)]
    assert len(losses[2]) == len(losses[1]) == 5, losses
    assert losses[1][-1] < losses[1][0] - 0.3, losses[1]  # it learns (the 2 batches are seen repeatedly)
    for a, b in zip(losses[2], losses[1]):
        assert abs(a - b) <= TOL * abs(b), losses


@pytest.mark.slow
def test_cp_example_matches_one_process():
    """examples/cp_loop.py: cp 2 ring and Ulysses, plain and Accelerate loops (cp_batch: the label shift done once,
    before
    the cut) vs the 1-process run, loss and grad norm per step."""
    cmd = [sys.executable, "examples/cp_loop.py"]
    procs = {
        n: start_python(
            cmd[1:] if n == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cmd[1:]],
            env(),
        )
        for n in (2, 1)
    }
    got = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        got[n] = re.findall(r"^([\w-]+) step (\d+) loss (\S+) grad_norm (\S+)$", out, re.MULTILINE)
    ref = {(m, s): (float(a), float(b)) for m, s, a, b in got[1]}
    assert len(got[2]) == len(got[1]) == 24, got
    for m, s, a, b in got[2]:
        assert rel(float(a), ref[m, s][0]) < TOL and rel(float(b), ref[m, s][1]) < TOL, (m, s, a, b, ref[m, s])
    assert ref["ring", "5"][0] < ref["ring", "1"][0] - 0.3, ref  # it learns


@pytest.mark.slow
def test_pp_example_matches_one_process(tmp_path):
    """examples/pp_loop.py: 2 pipeline stages (1F1B, tied embeddings synced, one norm over the stages) vs 1 process,
    loss and grad norm per step, and the merged checkpoint (hfpar.integrations.save_pipeline_pretrained) vs the
    reference's, both reloaded with from_pretrained."""
    from transformers import AutoModelForCausalLM  # (this test only: the others need no model here)

    cmd = [sys.executable, "examples/pp_loop.py", "--output_dir"]
    procs = {
        n: start_python(
            (cmd[1:] if n == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cmd[1:]])
            + [str(tmp_path / str(n))],
            env(),
        )
        for n in (2, 1)
    }
    got = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        got[n] = [
            (float(a), float(b)) for a, b in re.findall(r"^step \d+ loss (\S+) grad_norm (\S+)$", out, re.MULTILINE)
        ]
    assert len(got[2]) == len(got[1]) == 6, got
    for (a, b), (ra, rb) in zip(got[2], got[1]):
        assert rel(a, ra) < TOL and rel(b, rb) < TOL, got
    assert got[1][-1][0] < got[1][0][0] - 0.3, got[1]  # it learns
    mine, ref = (AutoModelForCausalLM.from_pretrained(tmp_path / str(n)).state_dict() for n in (2, 1))
    assert mine.keys() == ref.keys()
    for k, v in ref.items():
        assert ((mine[k] - v).abs().max() / v.abs().max()).item() < TOL, k
