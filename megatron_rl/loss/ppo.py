"""PPO-clip with dual clip (§1), DAPO clip-higher (§2.1) and DCPO dynamic bounds (§10.2)."""

from __future__ import annotations

import torch

from megatron_rl.loss.common import dual_clip, log_ratio, ppo_clip_stats, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def clipped_surrogate(ratio: Tensor, advantages: Tensor, low: Tensor | float,
                      high: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """``(L1, L2, max(L1, L2))``, ``L1 = -A r``, ``L2 = -A clamp(r, low, high)``; all ``[B, T]``."""
    loss1 = -advantages * ratio
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high))
    else:
        clipped = ratio.clamp(low, high)
    loss2 = -advantages * clipped
    return loss1, loss2, torch.maximum(loss1, loss2)


def ppo_token_loss(inp: LossInputs, cfg: LossParams, low: Tensor | float | None = None,
                   high: Tensor | float | None = None) -> TokenLoss:
    """§1 PPO-clip + hard dual clip; DAPO (§2.1) is this with ``clip_ratio_high=0.28``.

    ``low``/``high`` override the ratio bounds ``1 - clip_ratio_low`` / ``1 + clip_ratio_high``.
    Metrics: clip fractions, ``policy/dual_clip_frac`` (A < 0 and loss capped at -A c), ratio
    min/mean/max, ``policy/ppo_kl``.
    """
    low = 1.0 - cfg.clip_ratio_low if low is None else low
    high = 1.0 + cfg.clip_ratio_high if high is None else high
    ratio = torch.exp(log_ratio(inp.logp, inp.old_logp, cfg.log_ratio_clamp))
    a = inp.advantages
    loss1, loss2, loss_clip = clipped_surrogate(ratio, a, low, high)
    loss = dual_clip(loss_clip, a, cfg.clip_ratio_c)
    dual = ((loss_clip > -a * cfg.clip_ratio_c) & (a < 0)).float()
    stats = {**ppo_clip_stats(loss1, loss2, a, inp.mask), **ratio_stats(ratio, inp.mask),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask),
             "policy/dual_clip_frac": mean_stat(dual, inp.mask.float())}
    return TokenLoss(loss, stats)


def dcpo_bounds(old_logp: Tensor, eps_low: float, eps_high: float, clip_c: float
                ) -> tuple[Tensor, Tensor]:
    """§10.2 DCPO per-token ratio bounds ``(low, high)`` ``[B, T]`` from ``q = exp(old_logp)``.

    ``low = 0.5 + 0.5 sqrt(max(1 - 4 eps_low / q, 0))``,
    ``high = min(0.5 + 0.5 sqrt(1 + 4 eps_high / q), max(c, 10))``.
    """
    q = torch.exp(old_logp.detach().float())
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low / q, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / q), max=max(clip_c, 10.0))
    return low, high


def dcpo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§10.2 DCPO: PPO clip with :func:`dcpo_bounds` in place of ``[1-eps_low, 1+eps_high]``."""
    low, high = dcpo_bounds(inp.old_logp, cfg.clip_ratio_low, cfg.clip_ratio_high,
                            cfg.clip_ratio_c)
    return ppo_token_loss(inp, cfg, low=low, high=high)
