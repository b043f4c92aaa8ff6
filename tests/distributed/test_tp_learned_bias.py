"""A per-head attention bias the model learns and builds once outside its blocks (CPM-Ant's relative position
bias, (B, H, T, T), passed to every attention positionally), under TP=2 in a plain loop against the unsharded model
(benchmarks/tensor_parallel/family_sweep.py's check: loss and every gradient, one SGD step, again; float64, 1e-4):

- exact with its blocks sharded: the bias is cut to the rank's heads by a slice whose backward all-gathers, so the
  bias's parameters get their whole gradient on every rank (a plain slice gives them this rank's heads' part only:
  relative difference 1.0 in the sweep, which the block check, comparing the hidden states' gradient alone, passed);
  CPM-Ant's own loss on the logits keeps its LM head whole (hf_loss.computes_own_loss);
- the verification sees it: with a plain slice instead (the rank's heads' gradient only), apply_tensor_parallel
  refuses in one line naming the block input computed from parameters whose gradient differs (block_check checks
  the gradients of such inputs besides the hidden states').
"""

from __future__ import annotations

from unittest import mock

import pytest

from benchmarks.tensor_parallel.family_sweep import sweep_worker
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow


def _narrow(x, dim, group):
    from hfpar.parallel.comm import group_rank, group_size

    n = x.shape[dim] // group_size(group)
    return x.narrow(dim, group_rank(group) * n, n)  # the rank's heads; backward: those heads' gradient only


def _worker(rank: int, world: int) -> dict:
    good = sweep_worker(rank, world, ["cpmant"])["cpmant"]
    with mock.patch("hfpar.parallel.tensor_parallel.hooks.scatter_to_sequence_parallel_region", _narrow):
        bad = sweep_worker(rank, world, ["cpmant"])["cpmant"]
    return {"good": good, "bad": bad}


def test_learned_head_bias_is_exact_and_a_partial_gradient_is_refused():
    res = run_distributed(_worker, 2)[0]
    good, bad = res["good"], res["bad"]
    assert good["status"] == "exact" and good["blocks_sharded"] and good["worst_rel"] < 1e-10, good
    assert bad["status"] == "refused", bad
    assert "gradient of its input" in bad["why"] and "computed from parameters" in bad["why"], bad["why"]
