"""ASPO (Archer2.0): flipped IS ratio for positive tokens and soft dual clip (§8)."""

from __future__ import annotations

import torch

from megatron_rl.loss.common import log_ratio, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def entropy_quantile_clip_width(entropy: Tensor, mask: Tensor, quantile: float, eps_low_ent: float,
                                eps_high_ent: float) -> Tensor:
    """``[B, T]`` per-token clip width: ``eps_low_ent`` where the (detached) entropy is <= the
    per-sequence ``quantile`` of valid-token entropies (linear interpolation), else
    ``eps_high_ent``. Sequence-local, so no collective is needed.
    """
    h = entropy.detach().float()
    q = torch.nanquantile(torch.where(mask.bool(), h, torch.nan), quantile, dim=-1, keepdim=True)
    return torch.where(h <= q, torch.full_like(h, eps_low_ent), torch.full_like(h, eps_high_ent))


def aspo_per_token(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps: Tensor | float,
                   c_pos: float, c_neg: float, clamp: float) -> tuple[Tensor, dict[str, Tensor]]:
    """§8 per-token ASPO loss ``[B, T]`` and its clip indicators.

    A < 0: ``rho = max(r, 1-eps)``; ``-A rho`` if rho <= c_neg else ``-A c_neg logp`` (soft dual).
    A >= 0: ``rho = min(r, 1+eps)``; value ``-A / rho`` with gradient ``-A / r`` inside the band
    (``-A (rho/sg rho)/sg rho``), or ``-A c_pos logp`` when ``1/rho > c_pos``.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, clamp))
    a = advantages
    neg = a < 0
    rho_neg = torch.maximum(ratio, 1.0 - torch.as_tensor(eps))
    rho_pos = torch.minimum(ratio, 1.0 + torch.as_tensor(eps))
    neg_dual = rho_neg.detach() > c_neg
    pos_dual = 1.0 / rho_pos.detach() > c_pos
    loss_neg = torch.where(neg_dual, -a * c_neg * logp, -a * rho_neg)
    flipped = -a * (rho_pos / rho_pos.detach()) / rho_pos.detach()
    loss_pos = torch.where(pos_dual, -a * c_pos * logp, flipped)
    loss = torch.where(neg, loss_neg, loss_pos)
    rho_sel = torch.where(neg, rho_neg, rho_pos).detach()
    flags = {"ratio": ratio, "upper": ratio.detach() > rho_sel, "lower": ratio.detach() < rho_sel,
             "neg_dual": neg & neg_dual, "pos_dual": (a > 0) & pos_dual}
    return loss, flags


def aspo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§8 ASPO with entropy-quantile clip widths from the config (needs ``inp.entropy``)."""
    if inp.entropy is None:
        raise ValueError("policy_loss='aspo' needs LossInputs.entropy (current-policy token "
                         "entropy) for its entropy-quantile clip widths")
    eps = entropy_quantile_clip_width(inp.entropy, inp.mask, cfg.aspo_entropy_quantile,
                                      cfg.aspo_eps_low_entropy, cfg.aspo_eps_high_entropy)
    loss, f = aspo_per_token(inp.logp, inp.old_logp, inp.advantages, eps, cfg.aspo_c_pos,
                             cfg.aspo_c_neg, cfg.log_ratio_clamp)
    m = inp.mask.float()
    a = inp.advantages
    stats = {"aspo/clip_frac_upper": mean_stat(f["upper"].float(), m),
             "aspo/clip_frac_lower": mean_stat(f["lower"].float(), m),
             "aspo/neg_dual_clip_frac": mean_stat(f["neg_dual"].float(), m * (a < 0)),
             "aspo/pos_dual_clip_frac": mean_stat(f["pos_dual"].float(), m * (a > 0)),
             "aspo/high_width_frac": mean_stat((eps > cfg.aspo_eps_low_entropy).float(), m),
             **ratio_stats(f["ratio"], inp.mask), **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)
