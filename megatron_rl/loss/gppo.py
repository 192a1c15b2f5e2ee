"""GPPO, gradient-preserving clipping (Klear-Reasoner), and its positive-sample NLL (§7)."""

from __future__ import annotations

import torch

from megatron_rl.loss.common import dual_clip, log_ratio, ppo_clip_stats, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def gradient_preserving_clip(ratio: Tensor, low: float, high: float) -> Tensor:
    """``clip(r, low, high)`` in value, but a clipped token keeps the gradient ``bound * dlogp``.

    Outside the band the result is ``bound / sg(r) * r`` (value = bound, d/dlogp = bound).
    """
    r_sg = ratio.detach()
    out = torch.where(r_sg < low, low / r_sg * ratio, ratio)
    return torch.where(r_sg > high, high / r_sg * ratio, out)


def gppo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§7 GPPO: forward equals PPO/DAPO; clipped tokens get gradient weight (1-eps_l)/(1+eps_h).

    The hard dual clip for A < 0 (``clip_ratio_c``) is kept, as in the official code. No log-ratio
    clamp (the official GPPO code does not clamp).
    """
    ratio = torch.exp(log_ratio(inp.logp, inp.old_logp, None))
    a = inp.advantages
    loss1 = -a * ratio
    loss2 = -a * gradient_preserving_clip(ratio, 1.0 - cfg.clip_ratio_low,
                                          1.0 + cfg.clip_ratio_high)
    loss_clip = torch.maximum(loss1, loss2)
    loss = dual_clip(loss_clip, a, cfg.clip_ratio_c)
    dual = ((loss_clip > -a * cfg.clip_ratio_c) & (a < 0)).float()
    stats = {**ppo_clip_stats(loss1, loss2, a, inp.mask), **ratio_stats(ratio, inp.mask),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask),
             "policy/dual_clip_frac": mean_stat(dual, inp.mask.float())}
    return TokenLoss(loss, stats)


def positive_token_mask(mask: Tensor, positive: Tensor) -> Tensor:
    """``[B, T]`` bool: valid tokens of the sequences flagged ``positive`` (``[B]`` bool)."""
    return mask.bool() & positive.bool().unsqueeze(-1)
