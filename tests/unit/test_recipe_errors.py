"""User mistakes end with `hfpar: error: ...` lines and exit code 2, before any model is loaded."""

import pytest
import torch

from hfpar.distributed import gpus_per_node_problem
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
    err = _run(["--output_dir", str(tmp_path)], capsys)  # a user's folder of that name: never hfpar's to touch
    assert "checkpoint-10 (a directory without hfpar's COMPLETE marker" in err[0] and "move them out" in err[0]
    err = _run(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest", "--save_steps", "10"], capsys)
    assert len(err) == 1 and "holds what hfpar did not write: checkpoint-10" in err[0]
    err = _run(["--output_dir", str(tmp_path), "--overwrite_output_dir", "true"], capsys)  # not moved aside either
    assert len(err) == 1 and "never writes through a symlink nor moves or deletes a folder" in err[0]
    assert (tmp_path / "checkpoint-10" / "keep.txt").read_text() == "user data"


def test_almost_all_examples_lost_to_truncation_is_refused_per_split(tmp_path, capsys):
    from tests.unit.test_output_dir import long_prompts

    data = long_prompts(tmp_path / "almost_all.jsonl", lost=95, kept=5)
    err = _run(
        ["--dataset_name", str(data), "--eval_split_fraction", "0.5", "--output_dir", str(tmp_path / "o")], capsys
    )
    assert [x.split(": ")[2] for x in err[:2]] == ["train data", "eval data"], err  # (then: under one global batch)
    assert "49 of 50 examples left out (49 with every target token past --max_seq_length 128)" in err[0]
    assert "more than 90% of the examples would be left out" in err[0]


def test_resume_from_missing_path(tmp_path, capsys):
    err = _run(["--output_dir", str(tmp_path / "o"), "--resume_from_checkpoint", str(tmp_path / "nope")], capsys)
    assert "no such directory" in err[0]


def test_resume_from_incomplete_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoint-3").mkdir()
    err = _run(["--output_dir", str(tmp_path), "--resume_from_checkpoint", str(tmp_path / "checkpoint-3")], capsys)
    assert "incomplete" in err[0]


def test_cli_rejects_unknown_recipe(capsys):
    import hfpar.recipes
    from hfpar.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli(["train"])
    names = ", ".join(hfpar.recipes.builtin())  # classify, clm, dpo, sft, and any recipe module added since
    assert e.value.code == 2 and f"expected a recipe ({names}), got 'train'" in capsys.readouterr().err


def test_cli_recipes_are_the_registry_modules(capsys):
    """`hfpar --help` and `hfpar RECIPE` take the names from hfpar/recipes/ (a new module appears by itself)."""
    import hfpar.recipes
    from hfpar.cli import main as cli
    from hfpar.cli import recipe_names

    assert list(recipe_names()) == hfpar.recipes.builtin()
    cli(["--help"])
    assert f"one of: {', '.join(hfpar.recipes.builtin())}" in capsys.readouterr().out


def _bad_input_files(root):
    import json

    (root / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",\n')
    (root / "cols.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    (root / "long.jsonl").write_text(
        "".join(json.dumps({"prompt": "p" * 50, "completion": "c" * 50}) + "\n" for _ in range(20))
    )
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (root / "msgs.jsonl").write_text((json.dumps(turn) + "\n") * 20)
    from hfpar import data

    tok = data.load_tokenizer(None)
    tok.chat_template = None
    tok.save_pretrained(root / "notemplate")


BAD_INPUTS = {  # name: (argv, what the one line must say)
    "missing dataset file": (["--dataset_name", "{d}/nope.jsonl"], "nope.jsonl: no such file or directory"),
    "malformed JSONL": (["--dataset_name", "{d}/bad.jsonl"], "bad.jsonl: malformed JSON Lines at line 3"),
    "wrong columns": (
        ["--dataset_name", "{d}/cols.jsonl"],
        "found columns ['answer', 'question']; the sft recipe expects messages, or prompt + completion",
    ),
    "empty after filtering": (
        ["--dataset_name", "{d}/long.jsonl", "--max_seq_length", "16", "--truncation", "drop"],
        "no SFT example left after tokenization with max_seq_length 16 and truncation 'drop'",
    ),
    "no chat template": (
        ["--dataset_name", "{d}/msgs.jsonl", "--tokenizer_name_or_path", "{d}/notemplate"],
        "has no chat template, which the messages format needs",
    ),
    "non-positive batch": (
        ["--per_device_train_batch_size", "0"],
        "--per_device_train_batch_size 0: must be a positive integer",
    ),
    "non-positive steps": (["--max_steps", "-3"], "--max_steps -3: must be > 0, or -1 to use num_train_epochs"),
    "tp not dividing world": (["--tp_size", "2"], "--tp_size 2 does not divide the world size 1"),
    "ep not dividing dp": (["--ep_size", "2"], "--ep_size 2 does not divide the data-parallel size 1"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_before_any_model(name, tmp_path, capsys):
    _bad_input_files(tmp_path)
    argv, expected = BAD_INPUTS[name]
    argv = [a.format(d=tmp_path) for a in argv]
    err = _run([*argv, "--output_dir", str(tmp_path / "o")], capsys)
    print(f"{name}: {err}")
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_more_processes_than_gpus_is_refused_in_one_line(monkeypatch):
    """2 processes on a one-GPU node: refused before the Accelerator (and any process group) is built, naming the
    counts and the two ways out; nothing to say on CPU (no CUDA device visible) or when every process has a GPU."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    msg = gpus_per_node_problem()
    assert msg and "\n" not in msg and "2 processes per node" in msg and "1 CUDA device" in msg
    assert "--num_processes 1" in msg and "CUDA_VISIBLE_DEVICES=''" in msg
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpus_per_node_problem() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gpus_per_node_problem() is None
