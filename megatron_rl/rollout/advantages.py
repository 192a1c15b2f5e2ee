"""Advantage estimators (ALGORITHMS.md §3): GRPO, Dr.GRPO, RLOO, REINFORCE++ (+ baseline), GAE.

Outcome estimators take one scalar score per response ``[N]`` and a group id per response ``[N]``
(responses to the same prompt share an id) and return ``[N]``; broadcast to tokens with
:func:`broadcast_to_tokens`. Token estimators work on ``[B, T]`` with a ``[B, T]`` mask. These run
once per rollout batch (not in the micro-batch loop).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """``(inverse [N], number of groups)`` for arbitrary group ids."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def group_mean_std(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-response group ``(mean, unbiased std, size)``, each ``[N]`` (fp64 math, std of a
    singleton group = 0)."""
    x = scores.double()
    inv, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, torch.ones_like(x))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, x) / count
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, (x - mean[inv]) ** 2)
    var = sq / (count - 1).clamp_min(1)
    return mean[inv], var.sqrt()[inv], count[inv]


def grpo_advantages(scores: Tensor, group_ids: Tensor, eps: float = 1e-6,
                    norm_by_std: bool = True) -> Tensor:
    """§3.1 GRPO ``(R - mean_g) / (std_g + eps)`` with the unbiased std; a singleton group uses
    mean 0, std 1. ``norm_by_std=False`` is Dr.GRPO (§3.2): ``R - mean_g``. Returns ``[N]`` fp32."""
    mean, std, size = group_mean_std(scores, group_ids)
    single = size <= 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    centred = scores.double() - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return adv.float()


def dr_grpo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """§3.2 Dr.GRPO: ``R - mean_g`` (no std); pair with ``seq-mean-token-sum-norm``."""
    return grpo_advantages(scores, group_ids, norm_by_std=False)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """§3.3 RLOO ``R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_g)``; a singleton keeps ``R``."""
    mean, _, size = group_mean_std(scores, group_ids)
    x = scores.double()
    adv = torch.where(size > 1, size / (size - 1).clamp_min(1) * (x - mean), x)
    return adv.float()


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) * rsqrt(var_unbiased + eps)`` over valid tokens, times the mask; ``[B, T]``."""
    m = mask.bool()
    x = values.double()
    n = m.sum().clamp_min(1)
    mean = torch.where(m, x, 0.0).sum() / n
    var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp_min(1)
    return (torch.where(m, (x - mean) * torch.rsqrt(var + eps), 0.0)).float()


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the valid tokens ``s`` of a row, ``[B, T]``.

    Masked positions (padding, and the environment tokens between the turns of a multi-turn
    episode) contribute no reward and **carry** the running return unchanged, so earlier turns
    also receive the outcome; ``gamma`` applies once per valid token. The returns are 0 at masked
    positions. This follows verl's ``compute_reinforce_plus_plus_outcome_advantage`` after verl
    PR #7300 (ALGORITHMS.md §3.4); older verl reset the return at every masked position.
    """
    m = mask.bool()
    r = token_rewards.double()
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(m[:, t], running, 0.0)
    return out.float()


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """§3.4 REINFORCE++: whitened discounted returns over all valid tokens of the batch."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """§3.4 REINFORCE++-baseline: ``R - mean_g`` broadcast to tokens, whitened over the batch.

    A singleton group (one response per prompt, ``rollout.n = 1``) uses group mean 0, as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` does: subtracting a response's own
    score would make every advantage exactly 0. ``scores``/``group_ids`` ``[N]``, ``mask [N, T]``.
    """
    mean, _, size = group_mean_std(scores, group_ids)
    mean = torch.where(size <= 1, 0.0, mean)
    centred = (scores.double() - mean).float()
    return masked_whiten(broadcast_to_tokens(centred, mask), mask)


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """``[N] -> [N, T]``: every valid token of a response gets the response's value."""
    return seq_values.float().unsqueeze(-1) * mask.float()


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """GAE for a critic: ``(advantages [B, T], returns [B, T])``.

    ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``, where "next" is
    the next **valid** token (padding passes the running values through) and 0 after the last.
    ``returns = A + V`` (before whitening); advantages are whitened over valid tokens if ``whiten``.
    """
    m = mask.bool()
    r, v = token_rewards.double(), values.double()
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        valid = m[:, t]
        adv[:, t] = torch.where(valid, a_t, 0.0)
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, a_t, next_adv)
    returns = (adv + v) * m
    out = masked_whiten(adv, m) if whiten else adv.float() * m
    return out, returns.float()


def advantage_metrics(adv: Tensor, mask: Tensor, scores: Tensor | None = None,
                      group_ids: Tensor | None = None) -> dict[str, Tensor]:
    """Advantage mean/std/min/max over valid tokens; with scores, the zero-std group fraction."""
    m = mask.bool()
    vals = adv[m].double()
    out = {"adv/mean": vals.mean(), "adv/std": vals.std() if vals.numel() > 1 else vals.sum() * 0,
           "adv/min": vals.min(), "adv/max": vals.max()} if vals.numel() else {}
    if scores is not None and group_ids is not None:
        _, std, size = group_mean_std(scores, group_ids)
        inv, g = _group_index(group_ids)
        zero = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, (std == 0).double() / size)
        out["adv/zero_std_group_frac"] = zero.mean()
        out["reward/score_mean"] = scores.double().mean()
    return {k: v.float() for k, v in out.items()}
