"""ParallelError: a refusal of one of hfpar.parallel's functions, its parts kept as fields for the code that reacts.

    try:
        apply_expert_parallel(model, ep_group)
    except ParallelError as exc:
        exc.where          # "apply_expert_parallel": the function that refused
        exc.problems       # (Problem(reason, hint), ...): what is wrong, and what to do about it
        exc.reasons        # the reasons alone, "; "-joined (a caller that gives its own advice)
        exc.detail         # the message without `where: `
        str(exc)           # "apply_expert_parallel: <reason>; <hint>; <reason>..." one line, as users read it

A ValueError, so `except ValueError` still catches it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ParallelError", "Problem"]


@dataclass(frozen=True)
class Problem:
    reason: str  # what is wrong, naming the module and the values
    hint: str = ""  # what to do about it ("pass None ...", "pass plan={...}"); "" where the reason says it all

    def __str__(self) -> str:
        return f"{self.reason}; {self.hint}" if self.hint else self.reason


class ParallelError(ValueError):
    """One line: `where: problem; problem`, each problem `reason; hint`."""

    def __init__(self, where: str, problems: Iterable[Problem | str]):
        self.where = where
        self.problems = tuple(p if isinstance(p, Problem) else Problem(str(p)) for p in problems)
        super().__init__(f"{where}: {self.detail}")

    @property
    def detail(self) -> str:
        return "; ".join(map(str, self.problems))

    @property
    def reasons(self) -> str:
        return "; ".join(p.reason for p in self.problems)

    def __reduce__(self):  # pickles with its fields (e.g. across a process boundary)
        return (type(self), (self.where, self.problems))
