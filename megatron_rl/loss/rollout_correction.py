"""Off-policy correction: the three-policy decomposition and its importance-sampling weights.

Three policies take part in every update (AReaL's "decoupled PPO", Fu et al. 2025; verl's
"decoupled" rollout-correction mode):

* **behaviour** ``mu``: the rollout engine that sampled the tokens; its log-probs are
  ``rollout_logp`` (its own kernels, bf16, possibly an older weight version when rollouts run
  asynchronously);
* **proximal** ``pi_prox``: the actor's weights when the step's update starts; its log-probs are
  ``old_logp`` (the old-policy pass, recomputed by the training engine, constant for all epochs
  and mini-batches of the step);
* **current** ``pi_theta``: the weights being trained; ``logp`` (with gradient).

The policy loss clips the ratio to the proximal policy, and the correction weights each token by
the (detached) ratio of the proximal policy to the behaviour policy::

    r_t   = pi_theta / pi_prox   = exp(logp_t - old_logp_t)        # clipped by the policy loss
    rho_t = pi_prox  / mu        = exp(old_logp_t - rollout_logp_t) # detached; log clamped to +-20
    L_t   = w_t * loss_t(r_t, A_t)                                  # w_t = f(rho), detached

so the trust region is measured against a policy the trainer holds (the clip never chases the
engine's numerics or staleness) and the bias of sampling from ``mu`` is corrected by ``w``. The
menu of ``f`` (``C = rollout_correction_threshold``)::

    none:         w_t = 1
    tis:          w_t = min(rho_t, C)                                  # truncated IS
    mis:          w_t = rho_t * 1[1/C <= rho_t <= C]                   # masked IS
    icepop:       w_t = rho_t * 1[icepop_low <= rho_t <= icepop_high]  # two-sided token mask
    seq_mask_tis: g_i = exp(mean_{t valid} log rho_it)                 # geometric mean, per row
                  w_it = 1[seq_mask_low <= g_i <= seq_mask_high] * min(rho_it, C)

References (each mode follows one):

* ``tis``: F. Yao, L. Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (2025); verl ``compute_rollout_correction_weights(rollout_is="token")``
  (verl/trainer/ppo/rollout_corr_helper.py); NeMo-RL ``truncated_importance_sampling_type="tis"``.
* ``mis``: verl token rejection sampling ``rollout_rs="token"`` with ``[1/C, C]`` and the token
  IS weight kept on the survivors. AReaL's ``behav_imp_weight_cap`` is the one-sided form
  (``icepop`` with ``icepop_low=0``, ``icepop_high=cap``).
* ``icepop``: the IcePop post (Ling team, "Small Leak Can Sink a Great Ship", 2025: band
  [0.5, 5]); NeMo-RL ``truncated_importance_sampling_type="icepop"``
  (nemo_rl/algorithms/loss_functions.py ``ClippedPGLossFn``). The mask reads the detached
  ``rho`` (the old training policy over the inference policy, as in the post), so it never
  changes inside a step.
* ``seq_mask_tis``: verl ``RolloutCorrectionConfig.decoupled_geo_rs_token_tis`` (geometric RS
  with band [0.999, 1.001] + token TIS with ``C = 2``). NeMo-RL's ``"seq-mask-tis"`` uses the
  same sequence mask but keeps the *untruncated* ``rho`` on the kept rows; we truncate (verl),
  which is the same up to the rare tokens with ``rho > C`` inside a kept row.

Denominators under rejection (``rollout_correction_denominator``). The weights multiply the
per-token loss before the aggregation of any ``loss_agg_mode``; a token the correction rejects
(``Correction.masked``: weight zeroed by ``mis``, ``icepop`` or ``seq_mask_tis``) then either

* ``all`` (default): stays in the denominators, its contribution 0. NeMo-RL does this
  (``ClippedPGLossFn`` multiplies the masked IS weight into the token loss and keeps the token
  mask of the mean) and so does AReaL (its ``behav_imp_weight_cap`` zeroes the weight inside the
  same mean). It is the masked-IS estimate of the batch's token-mean objective: the rejection
  only removes terms, and the scale of the surviving tokens' gradient does not grow when many
  tokens are rejected (a stale or mismatched batch);
* ``kept``: leaves them. verl does this: ``compute_rollout_rejection_mask`` returns
  ``response_mask * mask`` and ``compute_rollout_correction_and_add_to_batch`` replaces the
  batch's ``response_mask`` with it (verl/trainer/ppo/rollout_corr_helper.py), so every term of
  the update (policy loss, KL, entropy) and its token/sequence counts see only the kept tokens.
  Here too: the policy, KL and entropy terms aggregate over the kept tokens, and the
  :class:`~megatron_rl.loss.context.ReductionContext` must carry their global counts
  (:func:`denominator_masks` gives its ``extra_masks``). A ``seq-mean-*`` mode then averages
  over the rows with a kept token, and a row's token mean over its kept tokens.

``tis`` and ``none`` reject nothing, so the option changes nothing for them. verl's optional
"veto" of whole sequences with a tiny token ratio is not offered (``seq_mask_tis`` or ``icepop``
cover it); the ``rollout_corr/*`` metrics always cover every valid token.

All tensors are ``[B, T]`` on the inputs' device (``mask`` bool); nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.loss.metrics import TokenStat, mean_stat
from megatron_rl.loss.params import (
    ROLLOUT_CORRECTION_DENOMINATORS,  # noqa: F401 - re-export
    ROLLOUT_CORRECTIONS,  # noqa: F401 - re-export
)

Tensor = torch.Tensor
LOG_RATIO_CLAMP = 20.0  # exp(+-20): verl's SAFETY_BOUND
KEPT, KEPT_ROWS = "kept", "kept_rows"  # ReductionContext extra counts of denominator "kept"


@dataclass(frozen=True)
class CorrectionBounds:
    """Thresholds of the menu (see the module docstring); defaults are the references'."""

    threshold: float = 2.0  # C: tis cap, mis band [1/C, C], seq_mask_tis token cap
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_low: float = 0.999
    seq_mask_high: float = 1.001


@dataclass(frozen=True)
class Correction:
    """Per-token weights of one micro-batch and what changed them (all ``[B, T]``, detached).

    ``weight``: fp32, 0 on invalid tokens; ``rho``: fp32 raw proximal/behaviour ratio;
    ``clipped``: valid tokens whose weight was truncated to ``C``; ``masked``: valid tokens whose
    weight was zeroed (token or sequence mask); ``seq_masked``: ``[B]`` bool, rows with a valid
    token rejected by the sequence mask (``seq_mask_tis`` only, else None).
    """

    weight: Tensor
    rho: Tensor
    clipped: Tensor
    masked: Tensor
    seq_masked: Tensor | None = None


def rollout_ratio(old_logp: Tensor, rollout_logp: Tensor, clamp: float = LOG_RATIO_CLAMP
                  ) -> Tensor:
    """``rho = exp(old_logp - rollout_logp)`` (detached fp32, log-ratio clamped to +-clamp)."""
    return torch.exp(log_ratio(old_logp, rollout_logp).clamp(-clamp, clamp))


def log_ratio(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """``old_logp - rollout_logp`` (detached fp32)."""
    return old_logp.detach().float() - rollout_logp.detach().float()


def check_mode(mode: str) -> None:
    """Raise ``ValueError`` naming the field and the allowed values."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r}; allowed: {list(ROLLOUT_CORRECTIONS)}")


def compute_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str,
                       bounds: CorrectionBounds = CorrectionBounds()) -> Correction:
    """The weights of ``mode`` (module docstring) and their clipped / masked tokens."""
    check_mode(mode)
    m = mask.bool()
    lr = log_ratio(old_logp, rollout_logp)
    rho = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    none = torch.zeros_like(m)
    seq_masked = None
    if mode == "none":
        w, clipped, masked = torch.ones_like(rho), none, none
    elif mode == "tis":
        clipped = rho > bounds.threshold
        w, masked = rho.clamp(max=bounds.threshold), none
    elif mode in ("mis", "icepop"):
        lo, hi = ((1.0 / bounds.threshold, bounds.threshold) if mode == "mis"
                  else (bounds.icepop_low, bounds.icepop_high))
        masked = (rho < lo) | (rho > hi)
        w, clipped = torch.where(masked, 0.0, rho), none
    else:  # seq_mask_tis: geometric mean of each row's valid-token ratios
        n = m.sum(-1, keepdim=True).clamp_min(1).float()
        geo = torch.exp((torch.where(m, lr, 0.0).sum(-1, keepdim=True) / n)
                        .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, 1]
        reject = (geo < bounds.seq_mask_low) | (geo > bounds.seq_mask_high)
        masked = reject.expand_as(m)
        clipped = ~masked & (rho > bounds.threshold)
        w = torch.where(masked, 0.0, rho.clamp(max=bounds.threshold))
        seq_masked = reject.squeeze(-1) & m.any(-1)
    zero = torch.zeros_like(w)
    return Correction(weight=torch.where(m, w, zero), rho=rho, clipped=clipped & m,
                      masked=masked & m, seq_masked=seq_masked)


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str,
                       threshold: float = 2.0, **bounds: float) -> Tensor:
    """Per-token weights ``w [B, T]`` (0 on invalid tokens) of ``mode``; ``bounds``: the other
    :class:`CorrectionBounds` fields."""
    return compute_correction(old_logp, rollout_logp, mask, mode,
                              CorrectionBounds(threshold=threshold, **bounds)).weight


def correction_stats(corr: Correction, mask: Tensor, mode: str) -> dict[str, TokenStat]:
    """Globally reduced metrics (``rollout_corr/*``) of one micro-batch's correction.

    Always: ``kl_k3`` (mean of ``rho - 1 - log rho``, a KL(behaviour || proximal) estimate),
    ``ratio_mean`` / ``ratio_max`` of ``rho``. With a correction (mode != none):
    ``weight_mean`` / ``weight_max`` of ``w``, ``clipped_frac`` (weight truncated to ``C``) and
    ``masked_frac`` (weight zeroed), over valid tokens; ``seq_masked_frac`` (rows rejected, of
    the rows with a valid token) for ``seq_mask_tis``. The plain gap ``|old - rollout|`` is
    logged once per step by the trainer (``rollout/logp_mismatch_*``), not per mini-batch.
    """
    m = mask.bool()
    rho = corr.rho
    k3 = rho - 1.0 - torch.log(rho)
    out = {"rollout_corr/kl_k3": mean_stat(k3, m),
           "rollout_corr/ratio_mean": mean_stat(rho, m),
           "rollout_corr/ratio_max": TokenStat(rho, m, "max")}
    if mode == "none":
        return out
    out.update({"rollout_corr/weight_mean": mean_stat(corr.weight, m),
                "rollout_corr/weight_max": TokenStat(corr.weight, m, "max"),
                "rollout_corr/clipped_frac": mean_stat(corr.clipped, m),
                "rollout_corr/masked_frac": mean_stat(corr.masked, m)})
    if corr.seq_masked is not None:
        out["rollout_corr/seq_masked_frac"] = mean_stat(corr.seq_masked, m.any(-1))
    return out


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str = "none",
                   bounds: CorrectionBounds = CorrectionBounds()) -> dict[str, TokenStat]:
    """:func:`correction_stats` of ``mode`` from the log-probs."""
    return correction_stats(compute_correction(old_logp, rollout_logp, mask, mode, bounds),
                            mask, mode)


def apply_rollout_correction(token_loss: Tensor, old_logp: Tensor, rollout_logp: Tensor,
                             mask: Tensor, mode: str,
                             bounds: CorrectionBounds | float = CorrectionBounds()
                             ) -> tuple[Tensor, dict[str, TokenStat]]:
    """``token_loss * w`` (``w`` detached, in ``token_loss``'s dtype) and the metrics.

    ``bounds``: a :class:`CorrectionBounds`, or a float ``C`` (the other bounds at defaults)."""
    if not isinstance(bounds, CorrectionBounds):
        bounds = CorrectionBounds(threshold=float(bounds))
    corr = compute_correction(old_logp, rollout_logp, mask, mode, bounds)
    stats = correction_stats(corr, mask, mode)
    if mode == "none":
        return token_loss, stats
    return token_loss * corr.weight.to(token_loss.dtype), stats


def bounds_of(cfg: object) -> CorrectionBounds:
    """The :class:`CorrectionBounds` of a loss config (``LossParams`` fields)."""
    return CorrectionBounds(threshold=cfg.rollout_correction_threshold,
                            icepop_low=cfg.icepop_low, icepop_high=cfg.icepop_high,
                            seq_mask_low=cfg.seq_mask_low, seq_mask_high=cfg.seq_mask_high)


def keeps_denominator(cfg: object) -> bool:
    """True when a loss config drops rejected tokens from the denominators (``kept``) and its
    mode can reject any (``mis``, ``icepop``, ``seq_mask_tis``)."""
    return (cfg.rollout_correction_denominator == "kept"
            and cfg.rollout_correction in ("mis", "icepop", "seq_mask_tis"))


def kept_mask(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: object) -> Tensor:
    """``[B, T]`` bool: valid tokens the correction of ``cfg`` does not reject."""
    corr = compute_correction(old_logp, rollout_logp, mask, cfg.rollout_correction, bounds_of(cfg))
    return mask.bool() & ~corr.masked


def denominator_masks(mbs: list[dict], cfg: object) -> dict[str, list[Tensor]]:
    """``ReductionContext.from_minibatch`` ``extra_masks`` for denominator ``kept`` (``{}``
    otherwise): per micro-batch the ``[B, T]`` kept tokens and the ``[B, 1]`` rows holding one;
    ``mbs`` carry ``mask``, ``old_logp`` and ``rollout_logp``."""
    if not keeps_denominator(cfg) or mbs[0].get("rollout_logp") is None:
        return {}
    kept = [kept_mask(mb["old_logp"], mb["rollout_logp"], mb["mask"], cfg) for mb in mbs]
    return {KEPT: kept, KEPT_ROWS: [k.any(-1, keepdim=True) for k in kept]}
