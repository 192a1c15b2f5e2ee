"""Advantages that need the actor's passes first: REINFORCE++ (ALGORITHMS.md §3.4).

REINFORCE++ puts the KL to the reference policy into the token rewards,
``r_t = -beta * (log pi_old - log pi_ref)_t``, plus the outcome reward on the last response token;
its advantages are the whitened discounted returns over all valid tokens of the step's batch. The
KL term needs ``old_logp`` and ``ref_logp``, which exist only after the old/ref passes, on the last
pipeline stage, and each DP rank holds only its rows: the whitening statistics are all-reduced over
the data-parallel group, so the result does not depend on the TP/PP/DP layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.rollout.advantages import discounted_returns

Tensor = torch.Tensor
LATE_ESTIMATORS = ("reinforce_pp",)


def is_late(estimator: str) -> bool:
    """True when ``estimator``'s advantages are computed after the old/ref passes."""
    return estimator in LATE_ESTIMATORS


def needs_reference(cfg) -> bool:
    """The run needs the frozen reference policy for a KL-in-reward term."""
    return is_late(cfg.trainer.advantage) and cfg.trainer.kl_in_reward_coef > 0


def token_rewards(reward: Tensor, mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None,
                  kl_coef: float) -> tuple[Tensor, Tensor]:
    """``(token rewards [N, S] fp32, per-token k1 KL [N, S])``: ``-kl_coef * (old - ref)`` on
    valid tokens, plus ``reward [N]`` on each row's last valid token (rows without a valid token
    get nothing). Same device as ``mask``."""
    m = mask.bool()
    kl = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    if ref_logp is not None and kl_coef > 0:
        kl = torch.where(m, old_logp.float() - ref_logp.float(), 0.0)
    out = -kl_coef * kl
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, pos, -1).max(dim=1).values  # [N], -1 for empty rows
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    out[rows, last[has]] += reward.to(out.device, torch.float32)[has]
    return out, kl


def whiten_across(values: Tensor, mask: Tensor, group=None, eps: float = 1e-8) -> Tensor:
    """``(x - mean) * rsqrt(var_unbiased + eps)`` over the valid tokens of every rank of ``group``
    (the result equals :func:`~megatron_rl.rollout.advantages.masked_whiten` on the concatenated
    batch); ``[N, S]`` fp32, zero on padding. Two all-reduces, no host sync."""
    m = mask.bool()
    x = values.double()
    s = torch.stack([m.sum().double(), torch.where(m, x, 0.0).sum()])
    if group is not None or dist.is_initialized():
        dist.all_reduce(s, group=group)
    n, mean = s[0].clamp_min(1), s[1] / s[0].clamp_min(1)
    sq = torch.where(m, (x - mean) ** 2, 0.0).sum()
    if group is not None or dist.is_initialized():
        dist.all_reduce(sq, group=group)
    var = sq / (n - 1).clamp_min(1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), 0.0).float()


def reinforce_pp(reward: Tensor, mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None,
                 kl_coef: float, group=None, gamma: float = 1.0) -> tuple[Tensor, dict]:
    """REINFORCE++ advantages ``[N, S]`` of this rank's rows and their metrics (mean k1 KL in the
    reward over all ranks of ``group``)."""
    r, kl = token_rewards(reward, mask, old_logp, ref_logp, kl_coef)
    adv = whiten_across(discounted_returns(r, mask, gamma), mask, group)
    s = torch.stack([kl.double().sum(), mask.double().sum()])
    if group is not None or dist.is_initialized():
        dist.all_reduce(s, group=group)
    return adv, {"advantage/kl_in_reward": (s[0] / s[1].clamp_min(1)).float()}


def add_late_advantages(local: dict, estimator: str, kl_coef: float) -> dict[str, float]:
    """Fill ``local["advantages"]`` for a late estimator (last pipeline stage, where ``old_logp``
    lives; a no-op elsewhere and for the outcome estimators). Returns metrics (last stage)."""
    if not is_late(estimator) or "old_logp" not in local:
        return {}
    from megatron.core import parallel_state as ps

    dev = local["old_logp"].device  # the collectives run on the log-probs' device
    adv, metrics = reinforce_pp(local["reward"].to(dev), local["mask"].to(dev),
                                local["old_logp"], local.get("ref_logp"), kl_coef,
                                group=ps.get_data_parallel_group())
    local["advantages"] = adv.to(local["advantages"].device)
    return {k: float(v) for k, v in metrics.items()}
