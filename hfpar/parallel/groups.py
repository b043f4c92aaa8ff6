"""Process groups from rank lists: the one place hfpar calls torch.distributed.new_group.

    my_tp_group = new_groups([[0, 1], [2, 3]])            # collective: every rank, every list, same order
    ep_lists, edp_lists = expert_rank_lists([[0, 2], [1, 3]], ep=2)

torch requires every rank to create every group, in the same order; each call returns the group of
the lists that contains this rank (None if none does, or when torch.distributed is not initialised).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist


def new_groups(rank_lists: Sequence[Sequence[int]]):
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        g = dist.new_group(list(ranks))
        if me in ranks:
            mine = g
    return mine


def expert_rank_lists(dp_lists: Sequence[Sequence[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Inside each data-parallel group D (size dp), EP groups are runs of ep consecutive entries
    D[i*ep:(i+1)*ep]; the expert-data-parallel group of a rank is D[j::ep] (ranks holding the same experts)."""
    ep_lists, edp_lists = [], []
    for d in dp_lists:
        d = list(d)
        ep_lists += [d[i : i + ep] for i in range(0, len(d), ep)]
        edp_lists += [d[j::ep] for j in range(ep)]
    return ep_lists, edp_lists
