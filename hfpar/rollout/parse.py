"""Conversational completions as TRL's GRPOTrainer hands them to reward functions.

    comps = assistant_messages(tokenizer, completion_ids, prompt_ids)   # [[{"role": "assistant", ...}], ...]

TRL 1.16 decodes a conversational completion with the tokenizer's own response parser when the tokenizer ships one
(`response_template`, or the older `response_schema`): the message then splits what the chat format marks (a
reasoning block, tool calls) from its `content`; otherwise the content is the plain decoded text. Written here rather
than imported: TRL is optional for hfpar (it is the comparison), and its parse_response is a few lines around
transformers' own `tokenizer.parse_response`, whose behaviour (the EOS left in the content, the fallback to plain
text on a malformed tool call) is reproduced as TRL does it (trl/chat_template_utils.py: parse_response,
_validate_tool_calls). hfpar's rollouts call no tools: `tools` is None, as TRL's without tools.
"""

from __future__ import annotations


def has_response_parser(tokenizer) -> bool:
    return getattr(tokenizer, "response_template", None) is not None or (
        getattr(tokenizer, "response_schema", None) is not None
    )


def _check_tool_calls(calls) -> None:
    """TRL's validation (a malformed call makes the whole message plain text); arguments default to {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list or None")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call must be a dict")
        func = call.get("function", call)
        if not isinstance(func, dict) or not isinstance(func.get("name"), str):
            raise ValueError("a tool call needs a name")
        if func.get("arguments") is None:
            func["arguments"] = {}


def _parsed(tokenizer, ids: list[int], prefix: list[int]) -> dict:
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            message = tokenizer.parse_response(ids, prefix=prefix, tools=None)
        else:  # the older response_schema parser takes no prefix
            message = tokenizer.parse_response(ids)
        if message is None:  # a completion cut so short that nothing parses
            raise ValueError("nothing parsed")
        if isinstance(message.get("content"), str) and tokenizer.eos_token:
            message["content"] = message["content"].removesuffix(tokenizer.eos_token)
        if not message.get("content"):
            message["content"] = ""
        if "tool_calls" in message:
            _check_tool_calls(message["tool_calls"])
    except (ValueError, TypeError):  # TRL's fallback: the plain text
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return message


def assistant_messages(tokenizer, completion_ids: list[list[int]], prompt_ids: list[list[int]]) -> list[list[dict]]:
    """One [assistant message] per completion: parsed where the tokenizer has a response parser, else its text."""
    if not has_response_parser(tokenizer):
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": t}] for t in texts]
    return [[_parsed(tokenizer, list(ids), list(prefix))] for ids, prefix in zip(completion_ids, prompt_ids)]
