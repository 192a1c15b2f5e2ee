"""FrozenLake on ``gymnasium`` (``FrozenLake-v1``), as text.

Maps come from gymnasium's ``generate_random_map(size, p, seed)`` (a path from S to G always
exists). Slipperiness uses gymnasium's own transition table: with ``is_slippery`` the intended
move happens with probability ``success_rate`` and each perpendicular move with
``(1 - success_rate) / 2`` (the study's "high" randomness is 0.8, "low" 0.98). Reward 1 on reaching
G, 0 otherwise (gymnasium's schedule); an unparsable reply is invalid: no move,
``-invalid_penalty``.

Observation: the grid with the player as ``P`` (``S`` start, ``F`` ice, ``H`` hole, ``G`` goal),
rows separated by newlines. Actions: ``L``, ``D``, ``R``, ``U``.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.envs.base import parse_direction

ACTIONS = {"L": 0, "D": 1, "R": 2, "U": 3}  # gymnasium's action ids


class FrozenLakeTextEnv:
    """One FrozenLake episode at a time (``reset(seed)`` draws a new map and start)."""

    def __init__(self, size: int = 4, success_rate: float = 0.8, frozen_p: float = 0.8,
                 invalid_penalty: float = 0.1) -> None:
        if size < 2:
            raise ValueError(f"env.size must be >= 2 for frozenlake, got {size}")
        if not 0.0 < success_rate <= 1.0:
            raise ValueError(f"env.success_rate must be in (0, 1], got {success_rate}")
        self.size, self.success_rate, self.frozen_p = size, success_rate, frozen_p
        self.invalid_penalty = invalid_penalty
        self.instructions = "FrozenLake: reach G, avoid H. Reply L, D, R or U.\n"
        self.env = None
        self.state = 0

    def reset(self, seed: int, noise_seed: int | None = None) -> str:
        """New map from ``seed``; the slip randomness is seeded by ``noise_seed`` (default
        ``seed``), so the rollouts of one group share the map but not their slips."""
        import gymnasium as gym
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        desc = generate_random_map(size=self.size, p=self.frozen_p, seed=seed)
        self.env = gym.make("FrozenLake-v1", desc=desc, is_slippery=self.success_rate < 1.0,
                            success_rate=self.success_rate).unwrapped
        self.state, _ = self.env.reset(seed=seed if noise_seed is None else noise_seed)
        return self.render()

    def render(self) -> str:
        """The grid as text, player as ``P``."""
        rows = [[c.decode() for c in row] for row in self.env.desc]
        r, c = divmod(int(self.state), self.size)
        rows[r][c] = "P"
        return "\n".join("".join(row) for row in rows) + "\n"

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.env is None:
            raise RuntimeError("FrozenLakeTextEnv.step before reset")
        move = parse_direction(action)
        if move is None:
            return self.render(), -self.invalid_penalty, False, {
                "success": False, "invalid": True, "action": None}
        self.state, reward, terminated, _, _ = self.env.step(ACTIONS[move])
        return self.render(), float(reward), bool(terminated), {
            "success": bool(reward > 0), "invalid": False, "action": move}
