"""DataError, the one exception of hfpar.data, raised for every user mistake with a one-line message.

from hfpar.data.errors import DataError  # except DataError as exc: print(exc)
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or tokenizer input. The message is one line naming the offending value."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
