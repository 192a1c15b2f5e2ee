"""GSPO and GSPO-token, length-normalised sequence ratio (§5)."""

from __future__ import annotations

import torch

from megatron_rl.loss.common import ppo_kl_stat
from megatron_rl.loss.metrics import TokenStat, mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``[B, 1]``: mean over valid tokens of ``logp - old_logp`` (log of the GSPO ratio s_i).

    A sequence lives in one micro-batch, so this is exact without any collective.
    """
    m = mask.bool()
    diff = torch.where(m, logp - old_logp, torch.zeros_like(logp))
    return (diff.sum(-1) / m.sum(-1).clamp_min(1)).unsqueeze(-1)


def _gspo_from_log_s(log_s: Tensor, inp: LossInputs, cfg: LossParams) -> TokenLoss:
    s = torch.exp(log_s.clamp(max=cfg.gspo_log_ratio_max))
    a = inp.advantages
    loss1 = -a * s
    loss2 = -a * s.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(loss1, loss2)
    m = inp.mask.float()
    s_tok = s.detach().expand_as(m)
    seq_valid = inp.mask.bool().any(-1, keepdim=True).float()
    stats = {"policy/clip_frac": mean_stat((loss2 > loss1).float(), m),
             "gspo/seq_ratio_min": TokenStat(s.detach()[:, :1], seq_valid, "min"),
             "gspo/seq_ratio_max": TokenStat(s.detach()[:, :1], seq_valid, "max"),
             "gspo/seq_ratio_mean": mean_stat(s.detach()[:, :1], seq_valid),
             "policy/ratio_token_mean": mean_stat(s_tok, m),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)


def gspo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§5 GSPO (sequence form): every token of sequence i carries ``max(-A s_i, -A clip(s_i))``,
    with the gradient flowing through ``log s_i`` (mean log-ratio). Aggregate seq-mean-token-mean.
    """
    log_s = sequence_log_ratio(inp.logp, inp.old_logp, inp.mask).expand_as(inp.logp)
    return _gspo_from_log_s(log_s, inp, cfg)


def gspo_token_level_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§5 GSPO-token: ``log s_it = sg(log s_i) + logp - sg(logp)``; per-token advantages allowed."""
    log_s = sequence_log_ratio(inp.logp, inp.old_logp, inp.mask).detach()
    log_s_t = log_s + inp.logp - inp.logp.detach()
    return _gspo_from_log_s(log_s_t, inp, cfg)
