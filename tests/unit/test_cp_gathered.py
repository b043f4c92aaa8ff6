"""A token mixer run on the whole rows under context parallelism (hfpar.parallel.context_parallel.gathered), on two
emulated cp ranks (threads, shard_check.EmulatedGroup's in-memory exchange): a running sum along the row (what a
Mamba / DeltaNet state does) gives each rank its positions of the one-process result, forward and backward; a padding
mask one rank passes as None (its part unpadded: Qwen3.5's linear-attention mask) and another as its part is the
whole rows' on both; ranks that pass different per-token arguments are refused on every rank instead of pairing the
wrong tensors (a real group would wait forever). One process, milliseconds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfpar.parallel.context_parallel import cp_rows, shard_batch, shift_labels
from hfpar.parallel.context_parallel.gathered import gather_mixers
from hfpar.parallel.context_parallel.shard_check import EmulatedGroup

T, CP = 8, 2


class RunningSum(nn.Module):
    """(B, T, H) -> cumulative sum along the row of the (masked) hidden states, times a weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def forward(self, hidden_states, attention_mask=None, seq_idx=None):
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None]
        return hidden_states.cumsum(dim=1) * self.w


def _shards(mask):
    ids = torch.arange(2 * T).view(2, T)
    return [
        shard_batch(shift_labels({"input_ids": ids, "labels": ids, "attention_mask": mask}), r, CP) for r in range(CP)
    ]


def test_each_rank_gets_its_positions_of_the_whole_rows_result():
    torch.manual_seed(0)
    x = torch.randn(2, T, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, -2:] = 0  # padding in rank 0's part only (positions 6, 7: its second chunk)
    ref = RunningSum()
    want = ref(x, attention_mask=mask)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (want * w).sum().backward()

    mod = RunningSum()
    gather_mixers(mod, ["tests.unit.test_cp_gathered.RunningSum"])
    group, shards = EmulatedGroup(CP), _shards(mask)
    xs = [x.detach()[:, rows.local].clone().requires_grad_(True) for _, rows in shards]

    def rank(r, local, rows):
        with cp_rows(rows, group, "ring"):
            part = local["attention_mask"]
            # what Qwen3.5 does: None where this rank's part holds no padding
            return mod(xs[r], attention_mask=None if bool((part == 1).all()) else part)

    outs = group.run(rank, shards)
    for out, (_, rows) in zip(outs, shards, strict=True):
        assert torch.equal(out, want.detach()[:, rows.local])
    sum((o * w[:, rows.local]).sum() for o, (_, rows) in zip(outs, shards, strict=True)).backward()
    got = torch.empty_like(x)
    for xr, (_, rows) in zip(xs, shards, strict=True):
        got[:, rows.local] = xr.grad
    assert torch.allclose(got, x.grad, rtol=0, atol=1e-12) and torch.allclose(mod.w.grad, ref.w.grad, atol=1e-12)


def test_ranks_with_different_per_token_arguments_are_refused():
    mod = RunningSum()
    gather_mixers(mod, ["tests.unit.test_cp_gathered.RunningSum"])
    group, shards = EmulatedGroup(CP), _shards(torch.ones(2, T, dtype=torch.long))
    x = torch.randn(2, T // CP, 4, dtype=torch.float64)

    def rank(r, local, rows):
        with cp_rows(rows, group, "ring"):
            return mod(x, seq_idx=torch.zeros(2, T // CP, dtype=torch.long) if r == 0 else None)

    refused = r"^context parallelism: the cp ranks called RunningSum with different per-token arguments \(this rank: "
    with pytest.raises(RuntimeError, match=refused):
        group.run(rank, shards)
