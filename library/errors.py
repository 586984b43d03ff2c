"""User-facing errors.

A ``UserError`` is a problem with the user's input (flags, TOML, data, model path). The entry point
prints its message on one line per problem and exits with code 2; nothing is written to the output
folder. Library code raises these instead of calling ``exit()`` or using ``assert`` on user input.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """One or more problems with the user's input, each a self-contained, actionable message."""

    exit_code = 2

    def __init__(self, *messages: str) -> None:
        if not messages:
            raise ValueError("UserError needs at least one message")
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean "x"?)' for the closest candidate, or '' when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f' (did you mean "{matches[0]}"?)' if matches else ""


class TrainingDiverged(RuntimeError):
    """Training stopped after ``--max_nan_steps`` non-finite updates in a row; the weights are the last good ones."""

    exit_code = 3
