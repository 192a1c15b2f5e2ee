"""The text-environment interface of multi-turn rollouts.

An environment is a small stateful object driven by one episode's conversation::

    obs = env.reset(seed)                       # text observation (the first user turn)
    obs, reward, done, info = env.step(action)  # the model's text reply -> next observation

``info`` always holds ``success`` (the episode's goal was reached), ``invalid`` (the reply was not a
legal action: the environment then leaves its state unchanged and gives ``-invalid_penalty``) and
``action`` (the parsed action name or None). Episodes end when the env says ``done`` or after
``max_turns`` replies (handled by the rollout, not the env).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

ACTION_WORDS = {"l": "L", "left": "L", "d": "D", "down": "D", "r": "R", "right": "R",
                "u": "U", "up": "U"}
_TOKEN = re.compile(r"[A-Za-z]+")


class TextEnv(Protocol):
    """What :mod:`megatron_rl.rollout.multiturn` needs from an environment."""

    instructions: str

    def reset(self, seed: int, noise_seed: int | None = None) -> str:
        """Start a new episode generated from ``seed`` (stochastic dynamics seeded by
        ``noise_seed``, default ``seed``); its first observation."""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply the model's reply; ``(observation, reward, done, info)``."""


def parse_direction(text: str) -> str | None:
    """The first word of ``text`` as one of ``L/D/R/U`` (also ``left``/``Down``...), else None.

    ``"R"`` -> ``"R"``, ``" up\\n"`` -> ``"U"``, ``"x"`` -> None, ``""`` -> None."""
    m = _TOKEN.search(text)
    return ACTION_WORDS.get(m.group(0).lower()) if m else None
