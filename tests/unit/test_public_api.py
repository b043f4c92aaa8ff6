"""The public API is visible to dir(hfpar) / autocomplete, and every name it lists resolves.

    python -m pytest -q tests/unit/test_public_api.py
"""

import hfpar


def test_dir_lists_every_public_name_and_each_resolves():
    names = dir(hfpar)
    for name in hfpar.__all__:
        assert name in names, name
        assert getattr(hfpar, name) is not None, name
    assert {"apply_tensor_parallel", "parallelize", "prepare_trainer", "prepare_accelerator"} <= set(names)
