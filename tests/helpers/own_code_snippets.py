"""Run the python snippets of docs/own-code.md as written, several in one process (tests/launch/test_own_code_docs.py).

    python tests/helpers/own_code_snippets.py WORKDIR INDEX [INDEX ...]

Every ```python block of the page is preceded by a marker saying how it runs:
    <!-- test: 2 processes -->                 under a 2-process launch; it checks itself against one process
    <!-- test: 2 processes, and 1 to compare --> also run alone; the test compares the last JSON line both print
Launched as one rank of N (RANK / WORLD_SIZE / MASTER_ADDR set by the test, as torchrun sets them), this script runs
the snippets INDEX... one after another in this process, each in its own directory WORKDIR/snippet-INDEX and with its
own rendezvous: HFPAR_SNIPPET_PORTS lists one TCPStore port per INDEX (hosted by the test), given to the snippet as
MASTER_PORT, so each snippet's `dist.init_process_group` (or Accelerate's) starts a fresh process group as under
torchrun. Between snippets the process group is destroyed and Accelerate's shared state reset. What each snippet
printed is written to WORKDIR/rank-<RANK>.json ({index: stdout}); a snippet that raises ends the process with its
traceback and exit code 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "own-code.md"
_BLOCK = re.compile(r"(?:<!-- test: (\d+) process(?:es)?(, and 1 to compare)? -->\n)?```python\n(.*?)```", re.S)


def snippets(page: str | None = None) -> list[tuple[int | None, bool, str]]:
    """(processes or None when unmarked, compared with a 1-process run, code) of each python block, in page order."""
    text = PAGE.read_text() if page is None else page
    return [(int(n) if n else None, bool(cmp), code) for n, cmp, code in _BLOCK.findall(text)]


def _reset() -> None:
    """What one snippet leaves in this process that the next must not inherit (a launch starts with neither)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415  (only once a snippet used it)

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def main() -> None:
    workdir, indices = Path(sys.argv[1]), [int(i) for i in sys.argv[2:]]
    ports = os.environ.get("HFPAR_SNIPPET_PORTS", "").split(",")
    codes = snippets()
    printed = {}
    for k, i in enumerate(indices):
        here = workdir / f"snippet-{i}"
        here.mkdir(parents=True, exist_ok=True)
        os.chdir(here)
        if "RANK" in os.environ:
            os.environ.update(MASTER_PORT=ports[k], TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        out, start, cpu = io.StringIO(), time.perf_counter(), time.process_time()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(codes[i][2], f"docs/own-code.md, snippet {i}", "exec"), {"__name__": "__main__"})  # noqa: S102
            _reset()
        except BaseException:  # noqa: BLE001 - the snippet's own traceback is the report
            sys.stderr.write(f"snippet {i} failed; it printed:\n{out.getvalue()}\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)  # a peer may be blocked in a collective: no clean shutdown
        printed[i] = out.getvalue()
        took = f"{time.perf_counter() - start:.1f} s, {time.process_time() - cpu:.1f} CPU-s"
        print(f"snippet {i}: {took}", file=sys.stderr, flush=True)
    (workdir / f"rank-{os.environ.get('RANK', 'alone')}.json").write_text(json.dumps(printed))


if __name__ == "__main__":
    main()
