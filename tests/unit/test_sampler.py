"""Global batches are the same set of samples for every (dp, accumulation) split; resume is O(1)."""

import pytest

from hfpar.train.sampler import GlobalBatchSampler, eval_shard


def _global_batch(n, per_device, dp, accum, step):
    out = []
    for r in range(dp):
        s = GlobalBatchSampler(n, per_device, dp, r, accum, seed=3)
        for mb in s.micro_batches(*divmod(step, s.steps_per_epoch)):
            out += mb
    return out


@pytest.mark.parametrize("split", [(8, 1, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 4, 1)])
def test_same_global_batch_for_every_split(split):
    per_device, dp, accum = split
    ref = _global_batch(50, 8, 1, 1, 0)
    for step in range(12):  # crosses epoch boundaries (6 steps per epoch)
        ref = _global_batch(50, 8, 1, 1, step)
        got = _global_batch(50, per_device, dp, accum, step)
        assert sorted(got) == sorted(ref) and len(set(got)) == 8


def test_ranks_disjoint_and_epochs_reshuffle():
    a = GlobalBatchSampler(64, 2, 2, 0, 2, seed=0)
    b = GlobalBatchSampler(64, 2, 2, 1, 2, seed=0)
    ia = sum(a.micro_batches(0, 0), [])
    ib = sum(b.micro_batches(0, 0), [])
    assert not set(ia) & set(ib)
    epoch0 = sum((sum(a.micro_batches(0, s), []) for s in range(a.steps_per_epoch)), [])
    epoch1 = sum((sum(a.micro_batches(1, s), []) for s in range(a.steps_per_epoch)), [])
    assert epoch0 != epoch1 and len(set(epoch0)) == len(epoch0)


def test_resume_continues_exactly():
    s = GlobalBatchSampler(40, 2, 1, 0, 2, seed=1)
    full = list(s.iterate(0, 25))
    resumed = list(s.iterate(13, 25))
    assert full[13:] == resumed


def test_too_small_dataset_is_refused():
    with pytest.raises(ValueError, match="fewer than one global batch of 16"):
        GlobalBatchSampler(10, 4, 2, 0, 2, seed=0)


def test_eval_shard_covers_everything_once_with_equal_batch_counts():
    shards = [eval_shard(23, 4, 3, r) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    seen = [i for s in shards for b in s for i in b if i is not None]
    assert sorted(seen) == list(range(23))


@pytest.mark.parametrize("per_device, dp, accum, splits", [(2, 2, 2, 2), (4, 2, 1, 2), (4, 3, 2, 4), (6, 2, 1, 3)])
def test_pipeline_splits_make_each_micro_batch_one_slice(per_device, dp, accum, splits):
    """Under a pipeline of `splits` micro-batches, micro-batch i of every dp rank together is one contiguous slice
    of the global batch: the rows of one micro-step of a one-process run with per_device * dp / splits rows and
    accum * splits steps (MoE routing statistics are per micro-batch); the global batch itself is unchanged."""
    n, part = 97, per_device // splits
    ranks = [GlobalBatchSampler(n, per_device, dp, r, accum, seed=5, splits=splits) for r in range(dp)]
    one = GlobalBatchSampler(n, part * dp, 1, 0, accum * splits, seed=5)
    for step in range(2 * ranks[0].steps_per_epoch + 1):  # crosses epochs
        at = divmod(step, ranks[0].steps_per_epoch)
        mine = [s.micro_batches(*at) for s in ranks]  # [rank][micro-step] -> rows
        ref = one.micro_batches(*at)  # [micro-step] -> rows
        for a in range(accum):
            for i in range(splits):
                rows = [x for r in range(dp) for x in mine[r][a][i * part : (i + 1) * part]]
                assert rows == ref[a * splits + i]
        assert sorted(x for per_rank in mine for mb in per_rank for x in mb) == sorted(x for mb in ref for x in mb)


def test_splits_of_one_are_the_plain_sampler():
    a = GlobalBatchSampler(40, 4, 2, 1, 2, seed=2)
    b = GlobalBatchSampler(40, 4, 2, 1, 2, seed=2, splits=1)
    assert list(a.iterate(0, 7)) == list(b.iterate(0, 7))
