"""Training/inference mismatch: per-token gap between the rollout engine's log-probs and the
actor's old log-probs, and the importance-sampling corrections that compensate for it.

The engine samples with its own kernels (bf16, fused sampling); the actor recomputes the same
tokens' log-probs (``old_logp``). Per valid token::

    rho_t = exp(old_logp_t - rollout_logp_t)          # pi_actor_old / pi_rollout
    tis:  w_t = min(rho_t, C)                         # truncated IS
    mis:  w_t = rho_t * 1[1/C <= rho_t <= C]          # masked IS (outliers get weight 0)
    none: w_t = 1

The policy loss of each token is multiplied by the detached ``w_t`` (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's rollout correction).
All tensors are ``[B, T]`` on the inputs' device.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.metrics import TokenStat, mean_stat

Tensor = torch.Tensor
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def rollout_ratio(old_logp: Tensor, rollout_logp: Tensor, clamp: float = 20.0) -> Tensor:
    """``rho = exp(old_logp - rollout_logp)`` (detached fp32, log-ratio clamped to +-clamp)."""
    diff = old_logp.detach().float() - rollout_logp.detach().float()
    return torch.exp(diff.clamp(-clamp, clamp))


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str,
                       threshold: float) -> Tensor:
    """Per-token weights ``w [B, T]`` (0 on invalid tokens) of ``mode`` with threshold ``C``."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r}; allowed: {list(ROLLOUT_CORRECTIONS)}")
    m = mask.bool()
    if mode == "none":
        return m.float()
    rho = rollout_ratio(old_logp, rollout_logp)
    if mode == "tis":
        w = rho.clamp(max=threshold)
    else:
        w = torch.where((rho >= 1.0 / threshold) & (rho <= threshold), rho, torch.zeros_like(rho))
    return torch.where(m, w, torch.zeros_like(w))


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, weights: Tensor
                   ) -> dict[str, TokenStat]:
    """Global per-token mismatch metrics: k3 KL(rollout || actor) estimate, mean weight and the
    fraction of tokens whose weight was changed (0 or capped). The plain gap |old - rollout| is
    logged once per step by the trainer (``rollout/logp_mismatch_*``), not per mini-batch."""
    m = mask.float()
    rho = rollout_ratio(old_logp, rollout_logp)
    k3 = rho - 1.0 - torch.log(rho)
    changed = (weights != rho).float()
    return {"rollout_corr/kl_k3": mean_stat(k3, m),
            "rollout_corr/weight_mean": mean_stat(weights, m),
            "rollout_corr/changed_frac": mean_stat(changed, m)}


def apply_rollout_correction(token_loss: Tensor, old_logp: Tensor, rollout_logp: Tensor,
                             mask: Tensor, mode: str, threshold: float
                             ) -> tuple[Tensor, dict[str, TokenStat]]:
    """``token_loss * w`` (w detached) and the mismatch metrics."""
    w = correction_weights(old_logp, rollout_logp, mask, mode, threshold)
    stats = mismatch_stats(old_logp, rollout_logp, mask, w if mode != "none" else
                           rollout_ratio(old_logp, rollout_logp))
    if mode == "none":
        return token_loss, stats
    return token_loss * w.to(token_loss.dtype), stats
