"""Chat formatting: render a conversation with the tokenizer's chat template and find the assistant replies.

text, spans = _render_chat(tokenizer, messages, 0, 0)  # spans: (start, end) characters of each reply
"""

from __future__ import annotations

from .errors import DataError, _one_line


def _check_messages(messages, index: int) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"example {index}: messages {messages!r} is not a non-empty list of {{role, content}}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"example {index}: message {m!r} needs a string 'role' and a string 'content'")
    return messages


def _render_chat(tokenizer, messages: list[dict], first_trainable: int, index: int) -> tuple[str, list]:
    """Rendered conversation + character spans of the assistant turns at index >= first_trainable.

    Turn k's span is what rendering messages[:k+1] adds to rendering messages[:k] with the generation
    prompt: the reply and whatever closes it (eos / end-of-turn). This works for any template, no
    {% generation %} markers needed. Templates that render earlier turns differently than the last one
    (e.g. dropping reasoning) fall back to locating the reply text in the full rendering.
    """
    # lazy: +40 ms at import (python -X importtime), needed only by the messages format
    from jinja2 import TemplateError

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    try:
        full = render(messages, False)
        spans, search_from = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k < first_trainable:
                continue
            upto = render(messages[: k + 1], False)
            before = render(messages[:k], True) if k else None
            if before is not None and full.startswith(upto) and upto.startswith(before):
                span = (len(before), len(upto))
            else:
                span = _locate_reply(full, m["content"], search_from, tokenizer.eos_token, index, k)
            spans.append(span)
            search_from = span[1]
    except TemplateError as exc:
        raise DataError(f"example {index}: the chat template failed: {_one_line(exc)}") from None
    return full, spans


def _locate_reply(full: str, content: str, start: int, eos: str | None, index: int, k: int) -> tuple[int, int]:
    pos = full.find(content, start)
    if pos < 0:
        raise DataError(f"example {index}: assistant message {k} does not appear in the rendered chat template")
    end = pos + len(content)
    if eos and full.startswith(eos, end):
        end += len(eos)
    return pos, end
