"""User mistakes end with `hfpar: error: ...` lines and exit code 2, before any model is loaded."""

import pytest

from hfpar.recipe import main


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main("sft", argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err and all(line.startswith("hfpar: error: ") for line in err), err
    assert not any("Traceback" in line for line in err)
    return err


def test_misspelled_options_reported_together(capsys):
    err = _run(["--learning_rat", "1e-3", "--max_step", "3"], capsys)
    assert len(err) == 2 and "did you mean --learning_rate" in err[0] and "--max_steps" in err[1]


def test_bad_values_reported_together(capsys):
    err = _run(["--per_device_train_batch_size", "0", "--max_steps", "0", "--truncation", "chop"], capsys)
    assert len(err) == 3


def test_output_dir_with_checkpoints_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "keep.txt").write_text("user data")
    err = _run(["--output_dir", str(tmp_path)], capsys)
    assert "already holds checkpoints" in err[0] and "--overwrite_output_dir" in err[0]
    assert (tmp_path / "checkpoint-10" / "keep.txt").read_text() == "user data"


def test_resume_from_missing_path(tmp_path, capsys):
    err = _run(["--output_dir", str(tmp_path / "o"), "--resume_from_checkpoint", str(tmp_path / "nope")], capsys)
    assert "no such directory" in err[0]


def test_resume_from_incomplete_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint-3").mkdir()
    err = _run(["--output_dir", str(tmp_path), "--resume_from_checkpoint", str(tmp_path / "checkpoint-3")], capsys)
    assert "incomplete" in err[0]


def test_cli_rejects_unknown_recipe(capsys):
    from hfpar.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli(["train"])
    assert e.value.code == 2 and "expected a recipe (sft, clm, classify), got 'train'" in capsys.readouterr().err
