"""A recipe run in which one rank alone finds a problem (tests/launch/test_output_dir.py): the refusal must reach
the user from that rank, once, with no traceback of the ranks that lose their peer.

    hfpar launch --config_file accelerate_configs/ddp.yaml --num_processes 2 tests/helpers/refuse_on_rank.py WHERE ARGS

WHERE: `options` (before the process group exists: parse_args of rank 1 raises), or `data` (after it: rank 1's
tokenizer load raises while rank 0 goes on to the data's barrier). A real problem found by one rank only is e.g. a
file that one node cannot read; here the failure is injected so that which rank finds it is certain.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hfpar import data, recipe  # noqa: E402
from hfpar.config import ConfigError  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def _only_rank1(real, exc):
    def wrapped(*a, **k):
        if RANK == 1:
            raise exc
        return real(*a, **k)

    return wrapped


if __name__ == "__main__":
    where, argv = sys.argv[1], sys.argv[2:]
    if where == "options":
        recipe.parse_args = _only_rank1(recipe.parse_args, ConfigError("rank 1 only: --planted_option 7 is refused"))
    else:
        data.load_tokenizer = _only_rank1(
            data.load_tokenizer, data.DataError("rank 1 only: tokenizer /planted unreadable")
        )
    recipe.main("sft", argv)
