"""Config parsing: HF names, YAML + CLI precedence, every problem collected and reported at once."""

import pytest

from hfpar.config import ConfigError, parse_args


def test_defaults_and_cli_override(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("learning_rate: 5.0e-4\nmax_steps: 7\npacking: true\noutput_dir: from_yaml\n")
    a = parse_args(["--config", str(cfg), "--max_steps", "9", "--gradient_checkpointing"], recipe="sft")
    assert a.learning_rate == 5e-4 and a.max_steps == 9 and a.packing and a.gradient_checkpointing
    assert a.output_dir == "from_yaml"
    assert a.tokenizer_path == a.model_name_or_path


def test_recipe_defaults_are_below_yaml_and_cli(tmp_path):
    a = parse_args([], recipe="sft", defaults={"max_steps": 3, "learning_rate": 1e-2})
    assert a.max_steps == 3
    a = parse_args(["--max_steps", "4"], recipe="sft", defaults={"max_steps": 3})
    assert a.max_steps == 4


def test_bool_and_none_values():
    a = parse_args(["--packing", "false", "--eval_steps", "none", "--resume_from_checkpoint", "latest"])
    assert a.packing is False and a.eval_steps is None and a.resume_from_checkpoint == "latest"


def test_unknown_options_all_reported_with_suggestions():
    with pytest.raises(ConfigError) as e:
        parse_args(["--learning_rat", "1e-3", "--per_device_batch_size", "2"])
    msg = str(e.value)
    assert "--learning_rat" in msg and "did you mean --learning_rate" in msg
    assert "--per_device_batch_size" in msg and len(msg.splitlines()) == 2


def test_all_value_problems_collected_once():
    with pytest.raises(ConfigError) as e:
        parse_args(
            [
                "--per_device_train_batch_size",
                "0",
                "--max_steps",
                "-5",
                "--lr_scheduler_type",
                "cosinus",
                "--learning_rate",
                "-1",
                "--gradient_accumulation_steps",
                "abc",
            ]
        )
    lines = str(e.value).splitlines()
    # the type error is reported first (values are not validated until they parse)
    assert any("--gradient_accumulation_steps 'abc'" in x for x in lines)
    with pytest.raises(ConfigError) as e:
        parse_args(
            [
                "--per_device_train_batch_size",
                "0",
                "--max_steps",
                "-5",
                "--lr_scheduler_type",
                "cosinus",
                "--learning_rate",
                "-1",
            ]
        )
    lines = str(e.value).splitlines()
    assert len(lines) == 4
    assert any("--per_device_train_batch_size 0" in x for x in lines)
    assert any("--max_steps -5" in x for x in lines)
    assert any("'cosinus'" in x and "cosine" in x for x in lines)
    assert any("--learning_rate -1" in x for x in lines)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1, \n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_args(["--config", str(bad)])
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_step: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'max_step'.*max_steps"):
        parse_args(["--config", str(typo)])
    with pytest.raises(ConfigError, match="file not found"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])


def test_parallel_flags_validated():
    with pytest.raises(ConfigError, match="--sequence_parallel needs --tp_size"):
        parse_args(["--sequence_parallel"])
