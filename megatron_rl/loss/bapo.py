"""BAPO, balanced policy optimisation with adaptive clipping (Xi et al., arXiv 2510.18927).

PPO-clip whose ratio bounds ``[c_low, c_high]`` are chosen once per mini-batch so that the
positive-advantage tokens' contribution is at least ``bapo_target`` times the negative ones'
(the paper's remedy for off-policy updates dominated by negative tokens, which its
"Entropy-Clip Rule" links to entropy collapse)::

    pos(c_high) = sum_{A >= 0} min(r, c_high) A        neg(c_low) = sum_{A < 0} max(r, c_low) |A|
    rho(c_low, c_high) = pos / (neg + eps)              (inf when neg <= 0)

Search (the authors' order): start at ``(low_start, high_start)``; while ``rho < target`` raise
``c_low`` by ``low_step`` (capped at ``low_max``); then, while still below, raise ``c_high`` by
``high_step`` (capped at ``high_max``); stop at the first candidate that reaches the target, else
keep the last. The loss is then verl's vanilla PPO-clip with those bounds and the dual clip
``clip_ratio_c`` for ``A < 0`` (log-ratio clamp ``log_ratio_clamp``).

Reference code: WooooDyy/BAPO@7287044444d5d578529ea464b45f090a36e8da3a:recipe/bapo/policy_loss.py
(``_compute_effective_advantage``, ``compute_policy_loss_bapo``) and ``recipe/bapo/config.py`` /
``recipe/bapo/config/bapo_trainer.yaml`` (defaults: target 1, low 0.6 -> 0.8 step 0.05,
high 1.2 -> 2.0 step 0.05). Read, not copied; the bounds are explicit ratio bounds, not epsilons.

Deliberate differences:

* Scope of the sums: the reference searches once per loss call (one micro-batch, all-reduced over
  DP). Here :func:`bapo_bounds` sums over the **whole mini-batch** (every micro-batch, every DP
  rank: one all-reduce of ``n_low + n_high`` numbers), so the bounds and the gradient are the
  same for any layout, and every micro-batch of a mini-batch uses the same bounds.
* No host sync: the reference loops on host reads of its sums; here every candidate's sums are
  computed at once and the first one meeting the target is picked on the device (same choice).
* The ratio of the search is the current weights' (a no-grad pre-pass for updates after the
  first one of an RL step; ``old_logp`` itself for the first, where ``r = 1``). Sums in fp64.
* ``rho``: the reference's README calls ``rho_0`` "the target contribution of positive signals"
  while its code compares ``pos / neg`` with the target; we follow the code (``pos / neg``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.loss.common import log_ratio
from megatron_rl.loss.context import ReductionContext, as_list
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.ppo import ppo_token_loss
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


@dataclass
class BapoBounds:
    """The mini-batch's ratio bounds ``bounds`` (``[2]`` fp32 ``(c_low, c_high)``, on the inputs'
    device) and its global metrics (0-dim tensors)."""

    bounds: Tensor
    stats: dict[str, Tensor]


def bound_steps(start: float, stop: float, step: float) -> list[float]:
    """The values one bound takes in the search: ``start``, then ``+step`` capped at ``stop``
    while below ``stop`` (host floats, accumulated like the reference's loop)."""
    out, cur = [float(start)], float(start)
    while step > 0 and cur < stop:
        cur = min(cur + step, stop)
        out.append(cur)
    return out


def candidate_grid(cfg: LossParams) -> tuple[list[float], list[float]]:
    """``(lows, highs)``: candidate ``k`` is ``(lows[min(k, nl-1)], highs[max(0, k-nl+1)])``
    for ``k < nl + nh - 1`` (lower bound first, then the upper one)."""
    lows = bound_steps(cfg.bapo_low_start, cfg.bapo_low_max, cfg.bapo_low_step)
    highs = bound_steps(cfg.bapo_high_start, cfg.bapo_high_max, cfg.bapo_high_step)
    return lows, highs


def _local_sums(stat_logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                lows: Tensor, highs: Tensor, clamp: float) -> Tensor:
    """``[nl + nh]`` fp64: ``neg(low_i)`` then ``pos(high_j)`` of one micro-batch."""
    r = torch.exp(log_ratio(stat_logp.detach().double(), old_logp.detach().double(), clamp))
    a = adv.detach().double()
    valid = mask.bool()
    pos_w = torch.where(valid & (a >= 0), a, 0.0)
    neg_w = torch.where(valid & (a < 0), -a, 0.0)
    neg = [(torch.maximum(r, lo) * neg_w).sum() for lo in lows]
    pos = [(torch.minimum(r, hi) * pos_w).sum() for hi in highs]
    return torch.stack(neg + pos)


def pick_candidate(neg: Tensor, pos: Tensor, target: float, eps: float) -> Tensor:
    """Index (0-dim int64) of the first candidate with ``pos/(neg+eps) >= target``, else the last.
    ``neg`` ``[nl]`` and ``pos`` ``[nh]`` are the global sums per bound value."""
    nl, nh = neg.shape[0], pos.shape[0]
    k = torch.arange(nl + nh - 1, device=neg.device)
    li, hi = k.clamp(max=nl - 1), (k - (nl - 1)).clamp(min=0)
    n, p = neg[li], pos[hi]
    rho = torch.where(n > 0, p / (n + eps), torch.full_like(p, float("inf")))
    ok = rho >= target
    first = torch.argmax(ok.to(torch.int64))  # the first maximum: the first candidate that meets it
    return torch.where(ok.any(), first, torch.full_like(first, nl + nh - 2))


def bapo_bounds(ctx: ReductionContext, cfg: LossParams, stat_logp: Tensor | Sequence[Tensor],
                old_logp: Tensor | Sequence[Tensor], advantages: Tensor | Sequence[Tensor],
                masks: Tensor | Sequence[Tensor]) -> BapoBounds:
    """The mini-batch's BAPO bounds (see the module docstring); one ``all_reduce``, no host sync.

    Each argument is this rank's micro-batches (``[B_m, T_m]`` each): ``stat_logp`` the current
    weights' log-probs (``old_logp`` for the first update after a rollout), ``old_logp``,
    ``advantages``, ``masks``. Metrics: ``bapo/clip_low``, ``bapo/clip_high``,
    ``bapo/pos_frac`` (``pos / (pos + neg)`` at the chosen bounds) and ``bapo/search_steps``.
    """
    stats_l, olds, advs, ms = (as_list(x) for x in (stat_logp, old_logp, advantages, masks))
    dev = olds[0].device
    lows_h, highs_h = candidate_grid(cfg)
    lows = torch.tensor(lows_h, dtype=torch.float64, device=dev)
    highs = torch.tensor(highs_h, dtype=torch.float64, device=dev)
    total = torch.zeros(len(lows_h) + len(highs_h), dtype=torch.float64, device=dev)
    for s, o, a, m in zip(stats_l, olds, advs, ms):
        total = total + _local_sums(s, o, a, m, lows, highs, cfg.log_ratio_clamp)
    ctx.all_reduce(total)
    neg, pos = total[:len(lows_h)], total[len(lows_h):]
    k = pick_candidate(neg, pos, cfg.bapo_target, cfg.bapo_eps)
    # 1-element index tensors: indexing with a 0-dim tensor would read it on the host
    li = k.clamp(max=len(lows_h) - 1).reshape(1)
    hi = (k - (len(lows_h) - 1)).clamp(min=0).reshape(1)
    low, high = lows.index_select(0, li)[0], highs.index_select(0, hi)[0]
    p, n = pos.index_select(0, hi)[0], neg.index_select(0, li)[0]
    frac = torch.where(p + n > 0, p / (p + n).clamp_min(cfg.bapo_eps), torch.zeros_like(p))
    bounds = torch.stack([low, high]).float()
    return BapoBounds(bounds, {"bapo/clip_low": low.float(), "bapo/clip_high": high.float(),
                               "bapo/pos_frac": frac.float(), "bapo/search_steps": k.float()})


def bapo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """PPO-clip + dual clip with the mini-batch's BAPO bounds ``inp.bapo_bounds`` (``[2]``)."""
    if inp.bapo_bounds is None:
        raise ValueError("policy_loss='bapo' needs LossInputs.bapo_bounds (from bapo_bounds(...) "
                         "once per mini-batch)")
    b = inp.bapo_bounds.to(device=inp.logp.device, dtype=torch.float32)
    return ppo_token_loss(inp, cfg, low=b[0], high=b[1])
