"""One micro-batch's total loss: policy loss (+ ERC gate) + positive NLL + KL + distillation +
entropy bonus.

Every term is aggregated with the context's global denominators, so the micro-batch shares add
up over micro-batches and DP ranks to the one-process mini-batch loss (see ``context.py``).
"""

from __future__ import annotations

import torch

from megatron_rl.loss.aggregation import aggregate
from megatron_rl.loss.config import LossConfig
from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.distill import distill_loss_tokens
from megatron_rl.loss.erc import erc_gate, erc_keep_mask, erc_stats
from megatron_rl.loss.gppo import positive_token_mask
from megatron_rl.loss.kl import kl_penalty
from megatron_rl.loss.metrics import TokenStat, mean_stat
from megatron_rl.loss.registry import get_policy_loss
from megatron_rl.loss.rollout_correction import (
    KEPT,
    KEPT_ROWS,
    bounds_of,
    compute_correction,
    correction_stats,
    keeps_denominator,
)
from megatron_rl.loss.siren import siren_loss
from megatron_rl.loss.types import LossInputs, LossOutput

Tensor = torch.Tensor


def compute_loss(inp: LossInputs, cfg: LossConfig, ctx: ReductionContext,
                 entropy_coeff: float | Tensor | None = None) -> LossOutput:
    """Loss share of one micro-batch (0-dim fp32) and its metric records. No host sync.

    ``entropy_coeff`` (e.g. ``AdaptiveEntropyController.alpha``) overrides ``cfg.entropy_coeff``.
    The positive NLL term (``positive_nll_coef > 0``) needs ``inp.positive`` and a context built
    with ``extra_masks={"positive": ...}`` (its token-mean is over the global positive tokens).
    ``rollout_correction_denominator: kept`` (with a rejecting correction) needs a context built
    with :func:`~megatron_rl.loss.rollout_correction.denominator_masks` among its
    ``extra_masks``: the policy, KL and entropy terms aggregate over the kept tokens.
    """
    spec = get_policy_loss(cfg.policy_loss)
    for need in spec.needs:
        if getattr(inp, need) is None:
            raise ValueError(f"policy_loss={spec.name!r} needs LossInputs.{need}")
    mask = inp.mask.bool()
    token = spec.fn(inp, cfg)
    stats: dict[str, TokenStat] = dict(token.stats)
    per_token = token.loss
    if cfg.erc:
        if inp.entropy is None or inp.old_entropy is None:
            raise ValueError("erc=True needs LossInputs.entropy (current pass) and "
                             "LossInputs.old_entropy (old-policy pass)")
        keep = erc_keep_mask(inp.entropy, inp.old_entropy, mask, cfg.erc_low, cfg.erc_high)
        per_token = erc_gate(per_token, keep)
        stats.update(erc_stats(inp.entropy, inp.old_entropy, keep, mask))
    agg_mask, agg_ctx = mask, ctx  # the tokens and denominators of the update's terms
    if inp.rollout_logp is not None:
        corr = compute_correction(inp.old_logp, inp.rollout_logp, mask, cfg.rollout_correction,
                                  bounds_of(cfg))
        stats.update(correction_stats(corr, mask, cfg.rollout_correction))
        if cfg.rollout_correction != "none":
            per_token = per_token * corr.weight.to(per_token.dtype)
        if keeps_denominator(cfg):  # rejected tokens leave the denominators (verl)
            agg_mask, agg_ctx = mask & ~corr.masked, _kept_context(ctx)
    elif cfg.rollout_correction != "none":
        raise ValueError(f"rollout_correction={cfg.rollout_correction!r} needs "
                         "LossInputs.rollout_logp")
    mode = spec.forced_agg or cfg.loss_agg_mode
    # a loss already masked at padding needs no second mask unless a gate changed it since
    premasked = token.premasked and not cfg.erc and inp.rollout_logp is None
    pg_loss = aggregate(per_token, agg_mask, mode, agg_ctx, cfg.loss_scale_factor,
                        premasked=premasked)
    total = pg_loss
    stats["policy/pg_loss"] = TokenStat(pg_loss.detach(), None, "sum")
    if cfg.positive_nll_coef > 0:
        if inp.positive is None:
            raise ValueError("positive_nll_coef > 0 needs LossInputs.positive ([B] bool)")
        pos = positive_token_mask(mask, inp.positive)
        nll = torch.where(pos, -inp.logp, 0.0).sum() / ctx.count("positive").clamp_min(1).float()
        total = total + cfg.positive_nll_coef * nll
        stats["policy/positive_nll"] = TokenStat(nll.detach(), None, "sum")
    if cfg.use_kl_loss:
        if inp.ref_logp is None:
            raise ValueError("use_kl_loss=True needs LossInputs.ref_logp")
        kl = kl_penalty(inp.logp, inp.ref_logp, cfg.kl_loss_type)
        total = total + cfg.kl_loss_coef * aggregate(kl, agg_mask, mode, agg_ctx,
                                                     cfg.loss_scale_factor)
        stats["kl/mean"] = mean_stat(kl, mask.float())
    if cfg.distill_loss_coef > 0:  # on-policy distillation as a loss term (loss/distill.py)
        if inp.teacher_logp is None:
            raise ValueError("distill_loss_coef > 0 needs LossInputs.teacher_logp")
        k2 = distill_loss_tokens(inp.logp, inp.teacher_logp)
        total = total + cfg.distill_loss_coef * aggregate(k2, mask, mode, ctx,
                                                          cfg.loss_scale_factor)
        stats["distill/loss_k2"] = mean_stat(k2, mask.float())
    coeff = cfg.entropy_coeff if entropy_coeff is None else entropy_coeff
    if inp.entropy is not None:
        stats["policy/entropy"] = mean_stat(inp.entropy, mask.float())
        if not (isinstance(coeff, (int, float)) and coeff == 0):
            ent = aggregate(inp.entropy, agg_mask, mode, agg_ctx, cfg.loss_scale_factor)
            total = total - torch.as_tensor(coeff, dtype=ent.dtype, device=ent.device) * ent
    if cfg.siren_coef > 0:
        if inp.entropy is None or inp.siren is None:
            raise ValueError("siren_coef > 0 needs LossInputs.entropy (with its gradient) and "
                             "LossInputs.siren (siren_select(...) once per mini-batch)")
        reg = siren_loss(inp.entropy, inp.siren, cfg.siren_coef)
        total = total + reg
        stats["siren/reg"] = TokenStat(reg.detach(), None, "sum")
    coeff_t = (ctx.constant(coeff, mask.device) if isinstance(coeff, (int, float))
               else torch.as_tensor(coeff, dtype=torch.float64, device=mask.device).reshape(()))
    stats["entropy/coeff"] = TokenStat(coeff_t, None, "max")
    scale = ctx.grad_scale  # x * 1.0 == x (value and gradient): skip the no-op multiplication
    return LossOutput(loss=total, loss_for_backward=total if scale == 1.0 else total * scale,
                      pg_loss=pg_loss,
                      stats=stats)


def _kept_context(ctx: ReductionContext) -> ReductionContext:
    """``ctx`` with the global counts of the tokens the rollout correction keeps."""
    if KEPT not in ctx.extra_counts or KEPT_ROWS not in ctx.extra_counts:
        raise ValueError("loss.rollout_correction_denominator='kept' needs a ReductionContext "
                         "built with extra_masks=denominator_masks(...) "
                         "(megatron_rl.loss.rollout_correction)")
    return ctx.restricted(KEPT, KEPT_ROWS)
