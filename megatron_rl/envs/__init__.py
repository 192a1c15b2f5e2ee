"""Multi-turn text environments (FrozenLake on gymnasium, Sokoban from reasoning-gym)."""

from __future__ import annotations

from megatron_rl.envs.base import TextEnv, parse_direction
from megatron_rl.envs.frozenlake import FrozenLakeTextEnv
from megatron_rl.envs.sokoban import SokobanTextEnv

ENVS = ("frozenlake", "sokoban")


def make_env(section) -> TextEnv:
    """A fresh environment for the run's ``env`` config section (``EnvSection``)."""
    if section.name == "frozenlake":
        return FrozenLakeTextEnv(size=section.size, success_rate=section.success_rate,
                                 frozen_p=section.frozen_p,
                                 invalid_penalty=section.invalid_penalty)
    if section.name == "sokoban":
        return SokobanTextEnv(size=section.size, boxes=section.boxes,
                              invalid_penalty=section.invalid_penalty,
                              step_penalty=section.step_penalty)
    raise ValueError(f"env.name={section.name!r} is not one of {ENVS}")


__all__ = ["ENVS", "FrozenLakeTextEnv", "SokobanTextEnv", "TextEnv", "make_env",
           "parse_direction"]
