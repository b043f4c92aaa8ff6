"""The public API is visible to dir(hfpar) / autocomplete, and every name it lists resolves; cp_batch shifts once.

python -m pytest -q tests/unit/test_public_api.py
"""

import pytest
import torch

import hfpar
from hfpar.integrations.context_parallel import cp_batch


def test_dir_lists_every_public_name_and_each_resolves():
    names = dir(hfpar)
    for name in hfpar.__all__:
        assert name in names, name
        assert getattr(hfpar, name) is not None, name
    assert {"apply_tensor_parallel", "parallelize", "prepare_trainer", "prepare_accelerator"} <= set(names)


def test_cp_batch_shifts_labels_once_and_refuses_a_second_shift():
    ids = torch.arange(3, 11).view(1, 8)
    local, _ = cp_batch({"input_ids": ids, "labels": ids.clone()}, 0, 1)
    assert torch.equal(local["shift_labels"][0, :-1], ids[0, 1:]) and local["shift_labels"][0, -1] == -100
    assert torch.equal(local["labels"], local["shift_labels"])  # HF's loss takes shift_labels as they are
    with pytest.raises(ValueError, match="already has shift_labels"):
        cp_batch({"input_ids": ids, "labels": ids, "shift_labels": ids}, 0, 1)
