"""Generalised advantage estimation over the reply tokens of multi-turn episodes.

Semantics of verl's ``compute_gae_advantage_return`` (``verl/trainer/ppo/core_algos.py``) with a
response mask: the recursion runs backwards over positions; tokens outside the mask (prompt,
environment text, padding) are transparent — they neither change ``lastgaelam`` nor the "next
value" — so the reply tokens of all turns form one chain::

    delta_t   = r_t + gamma * V_next - V_t
    A_t       = delta_t + gamma * lam * A_next
    returns_t = A_t + V_t

with ``V_next = 0`` and ``A_next = 0`` after the last reply token. Advantages are then whitened
(mean 0, std 1 over the masked tokens of the whole batch; verl's ``masked_whiten``, unbiased
variance), with the statistics summed over the data-parallel group so that the result does not
depend on how rows are split over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, S]`` fp32 (zero outside ``mask``) from ``[B, S]`` inputs on
    one device; ``token_rewards`` is non-zero only at reply tokens (each turn's last)."""
    m = mask.float()
    r, v = token_rewards.float() * m, values.float() * m
    b, s = m.shape
    next_v = torch.zeros(b, device=m.device)
    last = torch.zeros(b, device=m.device)
    adv = torch.zeros_like(m)
    for t in reversed(range(s)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a_t = delta + gamma * lam * last
        adv[:, t] = a_t * m[:, t]
        next_v = v[:, t] * m[:, t] + (1 - m[:, t]) * next_v
        last = a_t * m[:, t] + (1 - m[:, t]) * last
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-8
                  ) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries of every rank in ``group`` (None:
    this process only); unbiased variance, as verl's ``masked_whiten``. Zero outside ``mask``."""
    m = mask.float()
    stats = torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).double()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    s1, s2, n = stats[0], stats[1], stats[2].clamp_min(1)
    mean = s1 / n
    var = (s2 / n - mean * mean) * (n / (n - 1).clamp_min(1))
    out = (x.double() - mean) * torch.rsqrt(var.clamp_min(0) + eps)
    return (out * m).to(x.dtype)
