"""Trackers (`--report_to`): names checked up front; tensorboard event files readable after a run.

    python -m pytest -q tests/unit/test_trackers.py

The end-to-end tensorboard check shares a launch with the LoRA tests (tests/launch/test_lora.py,
test_tensorboard_events_hold_the_logged_loss), using `tensorboard_scalars` (tests/helpers/outputs.py).
"""

from __future__ import annotations

import pytest

from hfpar.config import REPORT_TO, ConfigError, parse_args


def test_unknown_tracker_is_one_line_naming_it_and_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse_args(["--report_to", "tensorboard,tensorbord"])
    lines = str(e.value).splitlines()
    assert len(lines) == 1
    assert "'tensorbord'" in lines[0] and all(name in lines[0] for name in REPORT_TO)


def test_known_trackers_parse():
    assert parse_args(["--report_to", "tensorboard, wandb"]).report_to == "tensorboard, wandb"


def test_unknown_tracker_exits_before_work(tmp_path, capsys):
    from hfpar.recipe import main

    with pytest.raises(SystemExit) as e:
        main("sft", ["--report_to", "tb", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("hfpar: error: --report_to 'tb'")
    assert not (tmp_path / "o").exists()
