"""The reward recipe's data, loss and refusals, without training (fast; TRL equality: tests/unit/test_reward_trl.py).

    python -m pytest -q -p no:cacheprovider tests/unit/test_reward_data.py

- TRL 1.16's formats tokenize as its RewardTrainer does: explicit / implicit prompt, standard (eos appended) or
  conversational, already tokenized; pairs longer than max_length are left out and counted;
- the collator's two rows per pair (chosen first), the padding slot's IGNORE labels, the margin;
- RewardObjective's loss sum / pair count and metrics equal TRL's formulas (computed here by hand), padding slots
  counting nothing;
- mistakes end with one `hfpar: error:` line each, exit 2, before the model loads.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from hfpar import data
from hfpar.data.reward_pairs import RewardCollator, make_reward_pairs, tokenize_reward, tokenize_reward_pair
from hfpar.objectives.reward import RewardObjective
from hfpar.parallel.labels import IGNORE


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(None)


def test_formats_tokenize_as_trl(tok):
    eos = tok.eos_token
    text = tokenize_reward_pair({"prompt": "q ", "chosen": "yes", "rejected": "no" + eos}, tok, 0)
    assert text["chosen_ids"] == tok(text="q yes" + eos)["input_ids"]  # eos appended once, after the completion
    assert text["rejected_ids"] == tok(text="q no" + eos)["input_ids"]
    implicit = tokenize_reward_pair({"chosen": "q yes", "rejected": "q no"}, tok, 0)
    assert implicit == text
    msgs = make_reward_pairs(1)["eval"][0]
    conv = tokenize_reward_pair(msgs, tok, 0)
    whole = tok.apply_chat_template(msgs["prompt"] + msgs["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert conv["chosen_ids"] == list(whole) and conv["chosen_ids"][-1] == tok.eos_token_id
    ids = tokenize_reward_pair({"chosen_ids": [5, 6], "rejected_ids": [7]}, tok, 0)
    assert ids == {"chosen_ids": [5, 6], "rejected_ids": [7]}


def test_long_pairs_are_left_out_and_counted(tok):
    ds = Dataset.from_list([{"chosen": "a" * n, "rejected": "b", "margin": 0.5} for n in (3, 40, 5)])
    out, stats = tokenize_reward(ds, tok, max_length=10)
    assert stats == {"pairs": 2, "filtered_long": 1} and out[0]["margin"] == 0.5
    with pytest.raises(data.DataError, match="more than 90%"):
        tokenize_reward(ds, tok, max_length=2)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"chosen": "a", "rejected": "b", "margin": "big"}], "margin 'big' is not a finite number"),
        ([{"chosen": "a", "rejected": "b", "margin": math.inf}], "margin inf is not a finite number"),
        ([{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": []}], "both be text"),
        ([{"chosen": "a", "answer": "b"}], "no rejected column"),
    ],
)
def test_bad_data_is_one_line(tok, rows, match):
    with pytest.raises(data.DataError, match=match) as e:
        tokenize_reward(Dataset.from_list(rows), tok, 128)
    assert "\n" not in str(e.value)


def test_collator_rows_and_padding_slot():
    feats = [{"chosen_ids": [1, 2, 3], "rejected_ids": [4], "margin": 0.5}, {"chosen_ids": [5], "rejected_ids": [6, 7]}]
    feats[1]["margin"], feats[1]["no_targets"] = 1.0, True
    b = RewardCollator(0, pad_to_multiple_of=4)(feats)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0], [5, 0, 0, 0], [4, 0, 0, 0], [6, 7, 0, 0]]
    assert b["attention_mask"].sum(1).tolist() == [3, 1, 1, 2]
    assert b["labels"].tolist() == [1, IGNORE, 0, IGNORE] and b["margin"].tolist() == [0.5, 1.0]
    assert RewardObjective.count(b) == 1


@pytest.mark.parametrize("center,margin", [(None, None), (0.05, None), (0.05, [0.5, -0.2, 1.0, 0.0])])
def test_loss_and_metrics_are_trls(center, margin):
    torch.manual_seed(0)
    rewards = torch.randn(8, 1, dtype=torch.float64)  # 4 pairs, + 1 padding slot below
    pad = torch.tensor([[9.0], [-9.0]], dtype=torch.float64)
    out = torch.cat([rewards[:4], pad[:1], rewards[4:], pad[1:]])  # chosen rows, then rejected rows
    labels = torch.tensor([1, 1, 1, 1, IGNORE, 0, 0, 0, 0, IGNORE])
    obj = RewardObjective(center)
    batch = {"input_ids": torch.zeros(10, 3, dtype=torch.long), "labels": labels}
    if margin is not None:
        batch["margin"] = torch.tensor([*margin, 7.0], dtype=torch.float32)
    obj.before_micro(None, batch, None)
    assert "margin" not in batch  # no model input
    loss_sum, n = obj(out, labels)
    c, r = rewards[:4, 0], rewards[4:, 0]  # TRL's compute_loss, by hand
    m = torch.tensor(margin, dtype=torch.float32).double() if margin is not None else 0.0  # float32, as TRL
    trl = -F.logsigmoid(c - r - m).mean() + (center or 0.0) * ((c + r) ** 2).mean()
    assert n == 4 and float(loss_sum / n) == pytest.approx(float(trl), rel=1e-12)
    metrics = obj.metrics(obj.step_sums(torch.device("cpu")).tolist())
    assert metrics == pytest.approx(
        {
            "accuracy": float((c > r).double().mean()),
            "margin": float((c - r).mean()),
            "mean_reward": float(rewards.mean()),
            "min_reward": float(rewards.min()),
            "max_reward": float(rewards.max()),
        },
        rel=1e-12,
    )
    assert obj.metrics(obj.step_sums(torch.device("cpu")).tolist()) == {}  # reset after each step


def _refused(argv, capsys) -> list[str]:
    from hfpar.recipe import main

    with pytest.raises(SystemExit) as e:
        main("reward", argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err and all(line.startswith("hfpar: error: ") for line in err), err
    return err


def test_mistakes_are_refused_before_the_model_loads(tmp_path, capsys):
    err = _refused(["--output_dir", str(tmp_path / "a"), "--center_rewards_coefficient", "-1", "--packing"], capsys)
    assert len(err) == 2 and "must be >= 0" in err[0] and "--packing" in err[1]
    err = _refused(["--output_dir", str(tmp_path / "b"), "--cp_size", "2"], capsys)
    assert any("context parallelism is available for causal-LM recipes" in line for line in err), err
    bad = tmp_path / "pairs.jsonl"
    bad.write_text("".join(json.dumps({"chosen": "a", "rejected": "b", "margin": m}) + "\n" for m in ("x", "1")))
    err = _refused(["--output_dir", str(tmp_path / "c"), "--dataset_name", str(bad), "--eval_steps", "0"], capsys)
    assert len(err) == 1 and "margin 'x' is not a finite number" in err[0], err
    assert not (tmp_path / "c" / "model.safetensors").exists()
