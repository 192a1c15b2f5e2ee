"""The one exception of a bad run config (every layer that checks a config field raises it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and what is allowed."""
