"""docs/own-code.md's python snippets run as written, each under the processes its marker names, and agree with one
process (tests/helpers/own_code_snippets.py: how a snippet is marked and run).

    python -m pytest -q -p no:cacheprovider tests/launch/test_own_code_docs.py

Cheap: the 2-process snippets run one after another in ONE pair of processes (torch, transformers and hfpar imported
once per rank; each snippet gets its own process group, as under torchrun), next to one process running the snippets
that are compared by what they print (the Trainer one). Most snippets check themselves: they keep an unsharded copy
of the model and assert that loss, grad norm and weights agree within 1e-4 (the page's "Compare with one process").
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.helpers.launch import ROOT, env, forking_python
from tests.helpers.own_code_snippets import snippets

RUNNER = str(ROOT / "tests" / "helpers" / "own_code_snippets.py")
TOL = 1e-4  # the parity contract


def test_every_python_block_of_the_page_is_marked_with_how_it_runs():
    blocks = snippets()
    assert len(blocks) >= 6, blocks
    unmarked = [code.splitlines()[0] for n, _, code in blocks if n is None]
    assert not unmarked, f"python blocks of docs/own-code.md without a <!-- test: N processes --> marker: {unmarked}"
    assert {n for n, _, _ in blocks} == {2}, "the test runs 2-process snippets (add a launch for other counts)"
    page = (ROOT / "docs" / "own-code.md").read_text()
    assert "## Compare with one process" in page


def _start(workdir, indices, rank=None, world=1, ports=()):
    """One process running the snippets `indices`: rank `rank` of `world` (rendezvous `ports`), or alone (None)."""
    e = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    e.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # the snippets' gloo on CPU, on a GPU machine too
    if rank is not None:
        e.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            HFPAR_SNIPPET_PORTS=",".join(map(str, ports)),
        )
    workdir.mkdir(parents=True, exist_ok=True)
    err = open(workdir / f"stderr-{rank}", "w+")  # noqa: SIM115 - read back after the process ends
    python, e = forking_python(e)  # a fork of a pre-imported rank zygote (tests/helpers/rank_zygote.py)
    cmd = [python, RUNNER, str(workdir), *map(str, indices)]
    return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=err, stderr=subprocess.STDOUT, text=True), err


def _wait(procs: dict, timeout: float = 600) -> None:
    """All end with 0; the first failure kills the others (its peer may wait in a collective) and is reported."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs.values()):
        failed = [name for name, (p, _) in procs.items() if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p, _ in procs.values():
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for name, (p, log) in procs.items():
        p.wait()
        log.seek(0)
        text = log.read()
        log.close()
        assert p.returncode == 0, (name, p.returncode, text[-6000:])


def _last_json(printed: str):
    return json.loads(printed.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_snippets_run_as_written_and_match_one_process(tmp_path):
    blocks = snippets()
    two = [i for i, (n, _, _) in enumerate(blocks) if n == 2]
    compared = [i for i, (_, cmp, _) in enumerate(blocks) if cmp]
    stores = [  # one fresh rendezvous per snippet, as each torchrun launch has its own
        dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=120)) for _ in two
    ]
    ports = [s.port for s in stores]
    procs = {r: _start(tmp_path / "two", two, r, 2, ports) for r in range(2)}
    procs["alone"] = _start(tmp_path / "one", compared)
    _wait(procs)
    runs = {
        name: json.loads((tmp_path / d / f"rank-{name}.json").read_text())
        for name, d in ((0, "two"), (1, "two"), ("alone", "one"))
    }
    assert sorted(map(int, runs[0])) == two and sorted(map(int, runs[1])) == two
    for i in compared:
        got, ref = _last_json(runs[0][str(i)]), _last_json(runs["alone"][str(i)])
        assert len(got) == len(ref) >= 4, (i, got, ref)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < TOL, (i, got, ref)
        assert ref[-1] < ref[0], (i, ref)  # it learns
    assert (tmp_path / "two" / f"snippet-{compared[0]}" / "out" / "final" / "config.json").is_file()
