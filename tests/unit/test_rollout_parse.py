"""Conversational completions reach the reward functions as TRL 1.16's GRPOTrainer hands them: parsed by the
tokenizer's response parser where it ships one (a reasoning block and tool calls apart from the content; a
malformed tool call falls back to the plain text), the plain decoded text otherwise. Held to TRL's own
parse_response on the embedded tokenizer given Qwen3's chat template and TRL's response template for it."""

from __future__ import annotations

import pytest

from hfpar import data
from hfpar.rollout.loop import Rollout
from hfpar.rollout.parse import assistant_messages, has_response_parser
from hfpar.rollout.reward_log import RewardLog
from hfpar.rollout.rewards import resolve_reward_funcs

trl_utils = pytest.importorskip("trl.chat_template_utils")

TEXTS = [
    "<think>\nwhy\n</think>\n\n42",  # reasoning apart from the answer
    "plain 7",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',  # a tool call, no content
    '<tool_call>\n{"type":"function"</tool_call>',  # malformed: the plain text (TRL's fallback)
    '<tool_call>\n{"name": "g"}\n</tool_call>',  # no arguments: {} (TRL's normalisation)
]


@pytest.fixture(scope="module")
def tok():
    t = data.load_tokenizer(None)
    t.chat_template = trl_utils.qwen3_chat_template
    return trl_utils.add_response_schema(t)


def test_messages_equal_trls_parse_response(tok):
    assert has_response_parser(tok)
    prefix = tok(
        tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    )
    prefix = prefix["input_ids"]
    ids = [tok(t + tok.eos_token, add_special_tokens=False)["input_ids"] for t in TEXTS]
    ours = assistant_messages(tok, ids, [prefix] * len(ids))
    theirs = [[trl_utils.parse_response(tok, i, prefix=prefix)] for i in ids]
    assert ours == theirs
    assert ours[0] == [{"role": "assistant", "reasoning_content": "why", "content": "42"}]
    assert ours[3][0]["content"].startswith("<tool_call>")


def test_without_a_parser_the_content_is_the_text():
    plain = data.load_tokenizer(None)
    assert not has_response_parser(plain)
    ids = [plain("<think>\nwhy\n</think>\n\n42" + plain.eos_token, add_special_tokens=False)["input_ids"]]
    assert assistant_messages(plain, ids, [[]]) == [[{"role": "assistant", "content": "<think>\nwhy\n</think>\n\n42"}]]


SEEN: list = []


def record_completions(prompts, completions, **kwargs):
    SEEN.extend(completions)
    return [1.0] * len(completions)


def test_the_reward_functions_get_the_parsed_messages(tok):
    """Rollout._score (what scores every generation and evaluation) hands the reward functions those messages."""
    rollout = object.__new__(Rollout)  # only what _score reads
    rollout.owner, rollout.tokenizer, rollout.cfg = True, tok, type("Cfg", (), {"progress": None})()
    rollout.rewards = resolve_reward_funcs([f"{__name__}:record_completions"])
    rollout.reward_log = RewardLog()
    prompt = [{"role": "user", "content": "q"}]
    items = [{"prompt": prompt, "prompt_ids": [1, 2]}]
    ids = [tok(TEXTS[0] + tok.eos_token, add_special_tokens=False)["input_ids"]]
    SEEN.clear()
    rollout._score(items, ids, 0, [0])
    assert SEEN == [[{"role": "assistant", "reasoning_content": "why", "content": "42"}]]
