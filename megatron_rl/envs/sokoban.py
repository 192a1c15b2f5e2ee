"""Sokoban with reasoning-gym's generator (reverse-play room generation, solvable by its A*).

Rooms come from ``reasoning_gym.games.contrib.sokoban.src.generator.generate`` with a seeded
``random.Random``; moves are applied by its ``Game``/``Player`` (push-only), and the episode is
solved when every box is on a goal (its ``is_solved``). Reward: ``+1`` when solved,
``-step_penalty``
per move; an unparsable reply is invalid (no move, ``-invalid_penalty``).

Observation: reasoning-gym's characters (``*`` player, ``%`` player on goal, ``@`` box, ``X`` goal,
``$`` box on goal, ``+`` wall, ``-`` floor), one row per line. Actions: ``L``, ``D``, ``R``, ``U``.
"""

from __future__ import annotations

import functools
from random import Random
from typing import Any

import numpy as np

from megatron_rl.envs.base import parse_direction


@functools.lru_cache(maxsize=4096)
def generate_room(seed: int, size: int, boxes: int, max_depth: int) -> str:
    """reasoning-gym's room for ``seed`` (cached: the rollouts of a group share their room)."""
    from reasoning_gym.games.contrib.sokoban.src.generator import generate

    text, _solution, _ = generate(rng=Random(seed), min_w=size, min_h=size, max_w=size,
                                  max_h=size, min_boxes=boxes, max_boxes=boxes,
                                  max_depth=max_depth)
    return text


class SokobanTextEnv:
    """One Sokoban room at a time (``reset(seed)`` generates a new one)."""

    def __init__(self, size: int = 6, boxes: int = 1, max_depth: int = 40,
                 invalid_penalty: float = 0.1, step_penalty: float = 0.0) -> None:
        if not 5 <= size <= 20:
            raise ValueError(f"env.size must be in [5, 20] for sokoban, got {size}")
        self.size, self.boxes, self.max_depth = size, boxes, max_depth
        self.invalid_penalty, self.step_penalty = invalid_penalty, step_penalty
        self.instructions = ("Sokoban: push every @ onto an X (* is you, + is wall). "
                             "Reply L, D, R or U.\n")
        self.game = None

    def reset(self, seed: int, noise_seed: int | None = None) -> str:
        """New room from ``seed`` (Sokoban is deterministic: ``noise_seed`` is unused)."""
        from reasoning_gym.games.contrib.sokoban.src.game import Game

        text = generate_room(seed, self.size, self.boxes, self.max_depth)
        grid = np.array([list(line) for line in text.replace(" ", "").strip().split("\n")])
        self.game = Game(height=grid.shape[0], width=grid.shape[1])
        self.game.load_puzzle_matrix(grid)
        return self.render()

    def render(self) -> str:
        return "\n".join("".join(row) for row in self.game.get_matrix()) + "\n"

    def solved(self) -> bool:
        from reasoning_gym.games.contrib.sokoban.src.utils import is_solved

        return bool(is_solved(self.game.get_curr_state()))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.game is None:
            raise RuntimeError("SokobanTextEnv.step before reset")
        move = parse_direction(action)
        if move is None:
            return self.render(), -self.invalid_penalty, False, {
                "success": False, "invalid": True, "action": None}
        self.game.player.update(key=move)
        done = self.solved()
        reward = (1.0 if done else 0.0) - self.step_penalty
        return self.render(), reward, done, {"success": done, "invalid": False, "action": move}
