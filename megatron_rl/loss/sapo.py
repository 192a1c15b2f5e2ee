"""SAPO, soft adaptive policy optimisation (Gao et al., Qwen team, arXiv 2511.20347).

Objective (the paper's SAPO objective with its soft gate ``f``; equation numbers are not quoted
because only the abstract and secondary write-ups (verl, AReaL, ms-swift docs) could be read here)::

    J = E[ 1/G sum_i 1/|y_i| sum_t f_{i,t}(r_{i,t}) A_{i,t} ]
    f_{i,t}(x) = sigmoid(tau_{i,t} (x - 1)) * 4 / tau_{i,t},   tau = tau_pos if A > 0 else tau_neg

Per-token loss ``L = -f(r) A``. Its gradient with respect to ``logp`` is ``-A w(r)`` with the
soft-gate weight ``w(r) = 4 sigma (1 - sigma) r`` (``sigma = sigmoid(tau (r - 1))``): ``w(1) = 1``
(the on-policy policy gradient), and ``w`` decays smoothly (never to exactly zero) as ``r`` leaves
1, faster for larger ``tau``. This replaces PPO's hard clip, which sets the weight to 0 outside
``[1 - eps, 1 + eps]``. The value at ``r = 1`` is ``-2 A / tau`` (not ``-A``).

Reference function: verl ``compute_policy_loss_sapo`` (``core_algos.py`` @ b178a3cd):
``gate_function = sigmoid(tau (x - 1)) * 4 / tau``, ``taus = where(A > 0, tau_pos, tau_neg)``,
log-ratio clamped to [-20, 20], ``pg_losses = -gates * A``. Defaults ``tau_pos = 1.0``,
``tau_neg = 1.05`` from verl's ``actor.yaml`` / ``examples/sapo_trainer`` (the paper's Qwen3-30B
values; the paper recommends ``tau_neg > tau_pos``). AReaL's SAPO uses the same gate.

Deliberate differences:

* Aggregation: verl forces ``seq-mean-token-mean`` (the paper's 1/G sum_i 1/|y_i|); we default to
  it in the ``sapo`` preset but honour ``loss_agg_mode`` (e.g. ``token-mean`` for DAPO-style
  token weighting), with global denominators as for every loss.
* Metrics: verl logs clip fractions of 0; we log the mean soft-gate gradient weight
  ``sapo/grad_weight_mean`` (1 = on-policy PG) and its minimum.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.common import log_ratio, ppo_kl_stat, ratio_stats
from megatron_rl.loss.metrics import TokenStat, mean_stat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor


def sapo_temperature(advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """``[B, T]`` gate temperature: ``tau_pos`` where A > 0, else ``tau_neg`` (A <= 0, as verl)."""
    return torch.where(advantages > 0, torch.full_like(advantages, tau_pos),
                       torch.full_like(advantages, tau_neg))


def sapo_gate(ratio: Tensor, tau: Tensor) -> Tensor:
    """``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` ``[B, T]`` (differentiable in ``ratio``)."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_grad_weight(ratio: Tensor, tau: Tensor) -> Tensor:
    """``d f(r) / d logp = 4 sigma (1 - sigma) r`` ``[B, T]`` (detached; 1 at r = 1)."""
    r = ratio.detach()
    sig = torch.sigmoid(tau * (r - 1.0))
    return 4.0 * sig * (1.0 - sig) * r


def sapo_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """SAPO ``L = -f(r) A`` ``[B, T]``; metrics: soft-gate weight mean/min, ratio, ppo_kl."""
    ratio = torch.exp(log_ratio(inp.logp, inp.old_logp, cfg.log_ratio_clamp))
    tau = sapo_temperature(inp.advantages, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    loss = -sapo_gate(ratio, tau) * inp.advantages
    m = inp.mask.float()
    w = sapo_grad_weight(ratio, tau)
    stats = {"sapo/grad_weight_mean": mean_stat(w, m),
             "sapo/grad_weight_min": TokenStat(w, m, "min"),
             **ratio_stats(ratio, inp.mask), **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats)
