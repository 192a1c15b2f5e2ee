"""Entropy bonus and the Skywork-OR1 adaptive entropy controller (§10.1)."""

from __future__ import annotations

import torch

from megatron_rl.loss.context import ReductionContext, as_list

Tensor = torch.Tensor


def measured_entropy(old_logp: Tensor | list[Tensor], masks: Tensor | list[Tensor],
                     ctx: ReductionContext) -> Tensor:
    """§10.1 controller input e_k: ``-mean(old_logp)`` over the global valid tokens (0-dim fp64).

    One ``all_reduce`` of one number; call once per step over the step's training batch.
    """
    total = sum(torch.where(m.bool(), -o.detach().double(), 0.0).sum()
                for o, m in zip(as_list(old_logp), as_list(masks), strict=True))
    total = torch.as_tensor(total, dtype=torch.float64).reshape(())
    return ctx.all_reduce(total.clone()) / ctx.num_tokens.clamp_min(1).double()


class AdaptiveEntropyController:
    """Skywork-OR1 ``alpha_k = c_k * [e_k < target]`` with ``c`` stepped by ``±delta`` and clipped
    to ``[c_min, c_max]`` after each step (§10.1). State is kept in 0-dim fp64 tensors so
    :meth:`update` never syncs; save :meth:`state_dict` in checkpoints.
    """

    def __init__(self, target: float = 0.2, delta: float = 1e-4, c_min: float = 0.0,
                 c_max: float = 5e-3, c_init: float = 0.0) -> None:
        if not c_min <= c_init <= c_max:
            raise ValueError(f"entropy controller needs c_min <= c_init <= c_max, got "
                             f"{c_min} / {c_init} / {c_max}")
        if delta < 0:
            raise ValueError(f"entropy controller delta must be >= 0, got {delta}")
        self.target, self.delta, self.c_min, self.c_max = target, delta, c_min, c_max
        self.coeff = torch.tensor(float(c_init), dtype=torch.float64)
        self.enabled = torch.tensor(1.0, dtype=torch.float64)

    @property
    def alpha(self) -> Tensor:
        """The entropy coefficient to use during the current step (0-dim fp64)."""
        return self.coeff * self.enabled

    def update(self, measured: float | Tensor) -> None:
        """After a step with measured entropy ``e``: ``c += delta`` if ``e < target`` else
        ``c -= delta`` (equality is "not below"), clip, and set ``enabled = [e < target]``."""
        below = torch.as_tensor(measured, dtype=torch.float64) < self.target
        delta = torch.tensor(self.delta, dtype=torch.float64, device=below.device)
        step = torch.where(below, delta, -delta)
        self.coeff = (self.coeff.to(step.device) + step).clamp(self.c_min, self.c_max)
        self.enabled = below.to(torch.float64)

    def state_dict(self) -> dict[str, object]:
        return {"coeff": self.coeff.clone(), "enabled": self.enabled.clone(),
                "target": self.target, "delta": self.delta, "c_min": self.c_min,
                "c_max": self.c_max}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.coeff = torch.as_tensor(state["coeff"], dtype=torch.float64).clone()
        self.enabled = torch.as_tensor(state["enabled"], dtype=torch.float64).clone()
        for key in ("target", "delta", "c_min", "c_max"):
            setattr(self, key, float(state[key]))
