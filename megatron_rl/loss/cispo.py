"""CISPO (MiniMax-M1), clipped and detached IS weight times log-prob (§6)."""

from __future__ import annotations

import torch

from megatron_rl.loss.common import log_ratio, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss


def cispo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§6: ``L = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp``; every token keeps a gradient.

    ``policy/clip_frac`` = fraction of valid tokens whose weight was clipped (either side).
    """
    ratio = torch.exp(log_ratio(inp.logp, inp.old_logp, cfg.log_ratio_clamp))
    weight = ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high).detach()
    loss = -weight * inp.advantages * inp.logp
    m = inp.mask.float()
    stats = {"policy/clip_frac": mean_stat((weight != ratio.detach()).float(), m),
             **ratio_stats(ratio, inp.mask), **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)
