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


@pytest.mark.parametrize("name", ["sft", "clm", "classify", "dpo", "reward", "grpo"])
def test_demo_options_only_for_the_run_that_names_no_model(name, tmp_path, monkeypatch):
    """The embedded run's options (its tiny model's steps, learning rate, lengths) never reach a user's model: a run
    naming one (flag or --config) trains with the recipe's defaults, which --help shows; HFPAR_DEMO_OPTIONS=always
    (the suite's) gives every run the demo's, beneath its flags."""
    from hfpar import recipes

    r = recipes.get(name)
    kw = dict(recipe=name, defaults=dict(r.defaults), demo=dict(r.demo), args_class=r.args_class)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: some/model\n")
    monkeypatch.setenv("HFPAR_DEMO_OPTIONS", "auto")
    demo = parse_args([], **kw)
    for argv in (["--model_name_or_path", "some/model"], ["--config", str(cfg)]):
        user = parse_args(argv, **kw)
        assert user.max_steps == -1 and demo.max_steps == r.demo["max_steps"] > 0, argv
        assert user.learning_rate == r.defaults["learning_rate"] != demo.learning_rate == r.demo["learning_rate"]
    assert parse_args(["--model_name_or_path", "m", "--max_steps", "5"], **kw).max_steps == 5
    embedded = parse_args(["--model_name_or_path", "hfpar-tiny-vlm"], **kw, embedded=("hfpar-tiny", "hfpar-tiny-vlm"))
    assert embedded.max_steps == r.demo["max_steps"]  # an embedded model named: still the demo
    monkeypatch.setenv("HFPAR_DEMO_OPTIONS", "always")
    assert parse_args(["--model_name_or_path", "m"], **kw).max_steps == r.demo["max_steps"]
    monkeypatch.setenv("HFPAR_DEMO_OPTIONS", "sometimes")
    with pytest.raises(ConfigError, match="HFPAR_DEMO_OPTIONS=sometimes: valid values are auto"):
        parse_args([], **kw)


def test_help_shows_the_defaults_a_run_uses(capsys, monkeypatch):
    from hfpar import recipes

    r = recipes.get("grpo")
    with pytest.raises(SystemExit):
        parse_args(["--help"], recipe="grpo", defaults=dict(r.defaults), demo=dict(r.demo), args_class=r.args_class)
    out = " ".join(capsys.readouterr().out.split())
    assert "--learning_rate VALUE (default: 1e-06)" in out  # GRPOConfig's, not the demo's 3e-4
    assert "--max_completion_length VALUE new tokens per completion (GRPOConfig's) (default: 512)" in out
    assert "With no --model_name_or_path (the embedded demo run) these apply too: --max_steps 60" in out


def test_list_options_take_trl_space_separated_values():
    from hfpar import recipes

    r = recipes.get("grpo")
    a = parse_args(
        ["--reward_funcs", "exact_match", "numeric_match", "--reward_weights", "1", "0.5", "--report_to", "none"],
        recipe="grpo",
        args_class=r.args_class,
    )
    assert a.reward_funcs == "exact_match,numeric_match" and a.reward_weights == "1,0.5" and a.report_to == "none"
    assert parse_args(["--lora_target_modules", "q_proj,v_proj"]).lora_target_modules == "q_proj,v_proj"


@pytest.mark.parametrize("name,default", [("grpo", False), ("dpo", True), ("reward", True)])
def test_disable_dropout_with_trls_default(name, default):
    from hfpar import recipes

    cls = recipes.get(name).args_class
    assert parse_args([], recipe=name, args_class=cls).disable_dropout is default  # GRPOConfig / DPOConfig / ...
    assert parse_args(["--disable_dropout"], recipe=name, args_class=cls).disable_dropout is True


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_numpy_cannot_take_is_one_line(seed):
    with pytest.raises(ConfigError, match=rf"^--seed {seed}: must be an integer in \[0, 4294967295\]$"):
        parse_args(["--seed", seed])


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
