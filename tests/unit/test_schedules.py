"""hfpar's schedules equal transformers' (hfpar avoids importing transformers.optimization at start-up)."""

import pytest
import torch
from transformers.optimization import get_scheduler as hf_get_scheduler

from hfpar.config import SCHEDULERS
from hfpar.train.schedules import MIN_LR_RATE, get_scheduler


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (5, 5), (2, 37)])
def test_same_lr_as_transformers_every_step(name, warmup, total):
    lrs = []
    for make in (get_scheduler, hf_get_scheduler):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        kw = (
            {"scheduler_specific_kwargs": {"min_lr_rate": MIN_LR_RATE}}
            if make is hf_get_scheduler and name == "cosine_with_min_lr"
            else {}
        )
        sched = make(name, opt, num_warmup_steps=warmup, num_training_steps=total, **kw)
        seq = []
        for _ in range(total + 3):  # past the end too
            seq.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        lrs.append(seq)
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-12, abs=0), name


def test_unknown_name_is_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="valid values are"):
        get_scheduler("cosine_restarts", opt, 0, 10)
