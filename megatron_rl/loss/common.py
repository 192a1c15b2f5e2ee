"""Small shared pieces of the PPO-family losses (ALGORITHMS.md §0, §1)."""

from __future__ import annotations

import math

import torch

from megatron_rl.loss.metrics import TokenStat, mean_stat

Tensor = torch.Tensor


def log_ratio(logp: Tensor, old_logp: Tensor, clamp: float | None) -> Tensor:
    """``logp - old_logp`` ``[B, T]``, clamped to ``[-clamp, clamp]`` when ``clamp`` is finite
    (``None`` or ``inf``: no clamp)."""
    d = logp - old_logp
    return d if clamp is None or math.isinf(clamp) else d.clamp(-clamp, clamp)


def dual_clip(loss_clip: Tensor, advantages: Tensor, clip_c: float) -> Tensor:
    """Hard dual clip (§1): for A < 0 cap the loss at ``-A * c``; other tokens unchanged.
    ``c = inf`` switches it off (plain PPO-clip)."""
    if math.isinf(clip_c):
        return loss_clip
    capped = torch.minimum(loss_clip, -advantages * clip_c)
    return torch.where(advantages < 0, capped, loss_clip)


def ratio_stats(ratio: Tensor, mask: Tensor, prefix: str = "policy/ratio") -> dict[str, TokenStat]:
    """Global min / mean / max of the importance ratio over valid tokens."""
    r, m = ratio.detach(), mask.float()
    return {f"{prefix}_min": TokenStat(r, m, "min"), f"{prefix}_mean": mean_stat(r, m),
            f"{prefix}_max": TokenStat(r, m, "max")}


def ppo_clip_stats(loss1: Tensor, loss2: Tensor, advantages: Tensor, mask: Tensor
                   ) -> dict[str, TokenStat]:
    """PPO clip fractions over valid tokens: any side, upper (A>0), lower (A<0)."""
    m = mask.float()
    clipped = (loss2 > loss1).float()
    return {"policy/clip_frac": mean_stat(clipped, m),
            "policy/clip_frac_upper": mean_stat(clipped * (advantages > 0), m),
            "policy/clip_frac_lower": mean_stat(clipped * (advantages < 0), m)}


def ppo_kl_stat(logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, TokenStat]:
    """``policy/ppo_kl`` = mean(old_logp - logp), the k1 estimate of KL(pi_old || pi)."""
    return {"policy/ppo_kl": mean_stat(old_logp - logp, mask)}
