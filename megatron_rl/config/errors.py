"""The exception of a bad run config (every layer that checks a config field raises it) and the
"did you mean" hint its messages carry."""

from __future__ import annotations

import difflib
import typing


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and what is allowed."""


def closest(name: str, known: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest known name, or ``""``."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
