"""GMPO, geometric-mean policy optimisation (Zhao et al., arXiv 2507.20673).

Objective (the paper's clipped GMPO objective, written in log space as in its code; equation
numbers are not quoted because only the paper's abstract and summaries could be read here, so the
formula is taken from the authors' code below)::

    J = E[ 1/G sum_i A_i * exp( 1/|y_i| sum_t c_{i,t} ) ]
    c_{i,t} = min(d_t, clip(d_t, -eps_low, eps_high))   if A_i > 0
            = max(d_t, clip(d_t, -eps_low, eps_high))   if A_i < 0      d_t = logp_t - old_logp_t

i.e. the geometric mean over the response's tokens of the PPO-clipped token ratios
``|min(r A, clip(r) A)|``, times ``sgn(A_i)``. The clip acts on each token's log-ratio (the paper's
"token-level clipping", range ``(e^-0.4, e^0.4)``), so one outlier token moves the sequence ratio by
at most ``e^{eps/|y_i|}``. Per-token loss: ``L_i = -A_i * s_i`` with ``s_i = exp(mean_t c_{i,t})``,
placed on every valid token of sequence i; the gradient with respect to ``logp_t`` is
``-A_i * s_i / |y_i|`` for tokens whose clip is inactive and 0 for clipped tokens.

Reference functions: verl ``compute_policy_loss_geo_mean`` (``core_algos.py`` @ b178a3cd) and the
authors' ``train_zero_math_gmpo.py`` (callsys/GMPO, branch ``critic_type_modify == "gmpo"``):
the clipped log-ratio ``c`` (``negative_approx_kl_min``), the sequence ratio
``exp(sum(c * mask) / |y_i|)`` and ``pg_losses = -A_i * ratio``. Defaults ``eps_low = eps_high =
0.4`` (log space) from the authors' README and verl's ``examples/gmpo_trainer``.

Deliberate differences:

* Sign of the clip: taken from the sequence advantage ``A_i`` (mean of the valid tokens'
  advantages), as in the paper and the authors' code. verl uses each token's own sign, which only
  differs for per-token advantages (verl notes it supports sequence-level advantages only).
* The token log-ratio is first clamped to ``+-log_ratio_clamp`` (20), as our other losses do,
  so ``exp`` cannot overflow; verl leaves that clamp commented out.
* Aggregation: the per-sequence loss sits on every token, so ``seq-mean-token-mean`` (the preset)
  gives the paper's mean over sequences, over the global mini-batch's non-empty sequences; verl
  takes ``torch.mean`` over the micro-batch's rows (empty rows included). Other ``loss_agg_mode``
  values work and weight sequences by length (``token-mean``: ``sum_i |y_i| L_i / N_tokens``).
* ``rollout_correction`` multiplies each token's copy of ``L_i`` by that token's weight, so a
  sequence gets the arithmetic mean of its token weights under ``seq-mean-token-mean``; verl
  multiplies by the geometric mean.
* ``policy/clip_frac`` counts tokens whose clip is active (zero gradient); verl's ``pg_clipfrac``
  counts any token outside the band, whichever direction.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.common import log_ratio, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import TokenStat, mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def masked_row_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``[B, 1]`` mean of ``values [B, T]`` over each row's valid tokens (0 for an empty row).

    A sequence lives in one micro-batch, so this needs no collective.
    """
    m = mask.bool()
    total = torch.where(m, values, torch.zeros_like(values)).sum(-1, keepdim=True)
    return total / m.sum(-1, keepdim=True).clamp_min(1).to(values.dtype)


def gmpo_clipped_log_ratio(diff: Tensor, seq_adv: Tensor, clip_low: float, clip_high: float
                           ) -> Tensor:
    """``[B, T]`` clipped token log-ratio ``c``: ``min(d, clip(d))`` where the sequence advantage
    ``seq_adv [B, 1]`` is > 0, ``max(d, clip(d))`` where it is < 0, ``d`` where it is 0."""
    clipped = diff.clamp(-clip_low, clip_high)
    pos = torch.minimum(diff, clipped)
    neg = torch.maximum(diff, clipped)
    return torch.where(seq_adv > 0, pos, torch.where(seq_adv < 0, neg, diff))


def gmpo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """GMPO: ``L_i = -A_i * exp(mean_t c_{i,t})`` on every valid token of sequence i ``[B, T]``.

    Metrics: ``policy/clip_frac`` (+ ``_upper`` for A > 0, ``_lower`` for A < 0), the sequence
    ratio's min/mean/max (``gmpo/seq_ratio_*``), token ratio min/mean/max, ``policy/ppo_kl``.
    """
    m = inp.mask.bool()
    diff = log_ratio(inp.logp, inp.old_logp, cfg.log_ratio_clamp)
    seq_adv = masked_row_mean(inp.advantages, m)
    c = gmpo_clipped_log_ratio(diff, seq_adv, cfg.gmpo_clip_low, cfg.gmpo_clip_high)
    s = torch.exp(masked_row_mean(c, m))  # [B, 1], the geometric-mean sequence ratio
    loss = (-seq_adv * s).expand_as(inp.logp)
    mf = m.float()
    d = diff.detach()
    upper = (seq_adv > 0) & (d > cfg.gmpo_clip_high)
    lower = (seq_adv < 0) & (d < -cfg.gmpo_clip_low)
    seq_valid = m.any(-1, keepdim=True).float()
    s_d = s.detach()
    stats = {"policy/clip_frac": mean_stat((upper | lower).float(), mf),
             "policy/clip_frac_upper": mean_stat(upper.float(), mf),
             "policy/clip_frac_lower": mean_stat(lower.float(), mf),
             "gmpo/seq_ratio_min": TokenStat(s_d, seq_valid, "min"),
             "gmpo/seq_ratio_max": TokenStat(s_d, seq_valid, "max"),
             "gmpo/seq_ratio_mean": mean_stat(s_d, seq_valid),
             **ratio_stats(torch.exp(d), inp.mask),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)
