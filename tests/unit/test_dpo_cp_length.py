"""benchmarks/dpo/cp_length.py's pieces that its figures rest on, without running it (it takes minutes): a pair of
"length L" is L tokens (prompt + chosen + rejected) through the dpo recipe's own tokenization, and the limits and
the same-training comparison read the rows as the report says."""

from __future__ import annotations

import pytest

from benchmarks.dpo import cp_length
from hfpar.data import load_tokenizer
from hfpar.data.preference import tokenize_pair


@pytest.fixture(scope="module")
def bench():
    return cp_length


def test_a_pair_of_length_l_is_l_tokens(bench):
    tok = load_tokenizer(None)
    for i, ex in enumerate(bench.pairs(448) + bench.pairs(1000)):
        length = 448 if i < 2 else 1000
        p = tokenize_pair(ex, tok, i)
        n = [len(p[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")]
        assert sum(n) == length and n[0] == length // 4, n
        assert p["chosen_ids"] != p["rejected_ids"]


def test_limits_and_same_training(bench):
    def row(run, length, fits, loss=0.5):
        return {"run": run, "length": length, "fits": fits, "losses": [0.69, loss], "grad_norms": [3.0, 2.0]}

    rows = [
        row("cp1", 512, True),
        row("cp1", 1024, False),
        row("cp1", 768, True),
        row("cp2_ring", 512, True, 0.5 * (1 + 2e-5)),
        row("cp2_ring", 1024, True, 0.6),
        row("cp2_ring", 2048, False),
    ]
    lim = bench.limits(rows, ["cp1", "cp2_ring"], cap=16384)
    assert lim["cp1"] == {"longest_fit": 768, "shortest_over": 1024, "capped": False}
    assert lim["cp2_ring"]["longest_fit"] == 1024 and lim["cp2_ring"]["shortest_over"] == 2048
    par = {(p["run"], p["length"]): p for p in bench.parity(rows)}
    assert set(par) == {("cp2_ring", 512), ("cp2_ring", 1024)}
    assert par["cp2_ring", 512]["max_rel_diff"] == pytest.approx(2e-5) and par["cp2_ring", 512]["both_fit"]
    assert par["cp2_ring", 1024]["max_rel_diff"] == pytest.approx(0.2) and not par["cp2_ring", 1024]["both_fit"]
