"""DPPO, divergence proximal policy optimisation (Qi et al., "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv 2602.04879), Binary-TV (``dppo_tv``) and Binary-KL (``dppo_kl``).

PPO's trust region is a band on the ratio ``r = p / q`` (``p = pi(y_t)``, ``q = pi_old(y_t)``),
which over-restricts rare tokens (q = 1e-5 -> 1e-3 is r = 100) and under-restricts likely ones
(q = 0.99 -> 0.8 is r = 0.81). DPPO instead masks a token when a divergence between the old and the
new distribution, approximated on the binary split {y_t, everything else}, exceeds delta *and* the
update moves further away in the direction the advantage pushes (the paper's DPPO objective with
its Binary-TV / Binary-KL approximations; equation numbers are not quoted because only the authors'
README and code, not the PDF, could be read here)::

    TV:  D = |p - q|                                     (binary total variation)
    KL:  D = q log(q / p) + (1 - q) log((1 - q) / (1 - p))  (binary KL(old || new))
    keep_t = not (A > 0 and p > q and D > delta_high)  and  not (A <= 0 and p < q and D > delta_low)
    L_t    = -A_t * keep_t * min(r_t, C)     value; gradient -A_t * keep_t * min(r_t, C) * dlogp_t

(For TV the direction test is implied: ``p - q > delta_high`` already means ``p > q``.) ``C`` is
a truncated-importance-sampling cap in place of PPO's dual clip (the paper's §5.4 recommends a
large C). Tokens are masked by a stop-gradient mask, so a masked token gives no gradient.

Reference functions: verl ``compute_policy_loss_dppo_tv`` / ``compute_policy_loss_dppo_kl``
(verl 0.8, Feb 2026; read in the authors' ``sail-sg/Stable-RL`` port): ``valid_positive_mask =
(prob - old_prob) <= delta_high``, ``valid_negative_mask = (prob - old_prob) >= -delta_low``,
``binary_kl`` as above with ``| (prob <= old_prob)`` / ``| (prob >= old_prob)``,
``valid_mask = where(A > 0, positive, negative)``, ``truncated_ratio = clamp(r, max=C).detach()``,
``pg_losses = -A * truncated_ratio * log_prob * valid_mask``. prime-rl's default loss
(``prime_rl/trainer/rl/loss.py::default_loss_fn``) is the same Binary-TV mask with
``pg = keep * A * r`` (no cap) plus ``kl_tau * (log r)^2`` on every token (``kl_tau = 1e-3``):
our ``dppo_sq_log_ratio_coef``. Defaults: delta = 0.15 (TV) and 0.05 (KL), from the authors'
``examples/dppo_trainer/run_qwen30b_dppo.sh``; C = 20 (verl's fallback; the authors' script sets
1e4, i.e. no truncation, prime-rl has none); ``dppo_sq_log_ratio_coef = 0`` (verl, paper).

Deliberate differences:

* Value: ``-A keep min(r, C)`` (the surrogate's value, as in prime-rl) rather than verl's
  ``-A sg(min(r, C)) logp``; both have exactly the gradient ``-A keep min(r, C) dlogp``.
* Binary KL uses ``1 - p = -expm1(logp)`` (exact near p = 1) instead of verl's ``+1e-8`` in
  ``log((1 - q + 1e-8) / (1 - p + 1e-8))``.
* ``pi_old`` is the actor's recomputed ``old_logp``. The authors recommend measuring the trust
  region against the rollout engine's probabilities (verl ``bypass_mode``, prime-rl's only mode);
  here the engine/actor gap is handled separately by ``rollout_correction`` (TIS/MIS weights).
* ``policy/clip_frac`` = masked fraction (verl's ``pg_clipfrac``); verl's ``pg_clipfrac_lower``
  (kept tokens with r > C) is ``dppo/truncated_frac`` here.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.common import log_ratio, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def binary_tv(logp: Tensor, old_logp: Tensor) -> Tensor:
    """``[B, T]`` signed probability change ``p - q`` (its absolute value is the binary TV)."""
    return torch.exp(logp) - torch.exp(old_logp)


def binary_kl(logp: Tensor, old_logp: Tensor) -> Tensor:
    """``[B, T]`` KL(Bern(q) || Bern(p)) = ``q (log q - log p) + (1-q) (log(1-q) - log(1-p))``.

    ``1 - p`` is ``-expm1(logp)``; a term with ``1 - q = 0`` is 0; ``p = 1 > q`` gives +inf.
    """
    q = torch.exp(old_logp)
    one_m_q = -torch.expm1(old_logp)
    one_m_p = -torch.expm1(logp)
    tail = one_m_q * (torch.log(one_m_q) - torch.log(one_m_p))
    tail = torch.where(one_m_q > 0, tail, torch.zeros_like(tail))
    return q * (old_logp - logp) + tail


def dppo_keep_mask(logp: Tensor, old_logp: Tensor, advantages: Tensor, divergence: str,
                   delta_low: float, delta_high: float) -> Tensor:
    """bool ``[B, T]``: tokens inside the trust region (A > 0: may not rise past delta_high;
    A <= 0: may not fall past delta_low). ``divergence`` is ``"tv"`` or ``"kl"``. Detached."""
    lp, old = logp.detach(), old_logp.detach()
    if divergence == "tv":
        dp = binary_tv(lp, old)
        keep_pos, keep_neg = dp <= delta_high, dp >= -delta_low
    elif divergence == "kl":
        kl = binary_kl(lp, old)
        keep_pos = (kl <= delta_high) | (lp <= old)
        keep_neg = (kl <= delta_low) | (lp >= old)
    else:
        raise ValueError(f"divergence={divergence!r}; allowed: ['tv', 'kl']")
    return torch.where(advantages > 0, keep_pos, keep_neg)


def truncated_surrogate(logp: Tensor, ratio: Tensor, cap: float) -> Tensor:
    """``[B, T]`` with value ``min(r, C)`` and gradient ``min(r, C) * dlogp`` (weight detached)."""
    return ratio.detach().clamp(max=cap) * torch.exp(logp - logp.detach())


def _dppo_token_loss(inp: LossInputs, cfg: LossParams, divergence: str, delta_low: float,
                     delta_high: float) -> TokenLoss:
    lr = log_ratio(inp.logp, inp.old_logp, cfg.log_ratio_clamp)
    ratio = torch.exp(lr)
    a = inp.advantages
    keep = dppo_keep_mask(inp.logp, inp.old_logp, a, divergence, delta_low, delta_high)
    surrogate = truncated_surrogate(inp.logp, ratio, cfg.dppo_ratio_cap)
    loss = torch.where(keep, -a * surrogate, torch.zeros_like(surrogate))
    if cfg.dppo_sq_log_ratio_coef > 0:
        loss = loss + cfg.dppo_sq_log_ratio_coef * lr.square()
    m = inp.mask.float()
    masked = ~keep
    stats = {"policy/clip_frac": mean_stat(masked.float(), m),
             "policy/clip_frac_upper": mean_stat((masked & (a > 0)).float(), m),
             "policy/clip_frac_lower": mean_stat((masked & (a <= 0)).float(), m),
             "dppo/truncated_frac": mean_stat((keep & (ratio.detach() > cfg.dppo_ratio_cap))
                                              .float(), m),
             **ratio_stats(ratio, inp.mask), **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)


def dppo_tv_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """DPPO-Binary-TV ``[B, T]``: thresholds ``dppo_tv_delta_low/high``."""
    return _dppo_token_loss(inp, cfg, "tv", cfg.dppo_tv_delta_low, cfg.dppo_tv_delta_high)


def dppo_kl_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """DPPO-Binary-KL ``[B, T]``: thresholds ``dppo_kl_delta_low/high``."""
    return _dppo_token_loss(inp, cfg, "kl", cfg.dppo_kl_delta_low, cfg.dppo_kl_delta_high)
