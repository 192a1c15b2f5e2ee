"""Inputs and outputs of the policy losses (shapes and dtypes stated once, here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.loss.metrics import TokenStat

Tensor = torch.Tensor


@dataclass
class LossInputs:
    """Per-micro-batch tensors, all ``[B, T]`` fp32 unless stated.

    ``logp`` carries the gradient; ``old_logp``, ``advantages``, ``ref_logp`` and ``old_entropy``
    are constants. ``mask`` is bool/0-1 (1 = valid response token). ``entropy`` is the current
    full-vocabulary entropy (may carry gradient, for the entropy bonus). ``cov_selected`` is this
    micro-batch's slice of :func:`megatron_rl.loss.cov.select_cov_tokens` (Clip-Cov / KL-Cov only).
    ``positive`` is ``[B]`` bool: sequences counted as correct (GPPO positive NLL term).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    entropy: Tensor | None = None
    old_entropy: Tensor | None = None
    ref_logp: Tensor | None = None
    cov_selected: Tensor | None = None
    positive: Tensor | None = None
    rollout_logp: Tensor | None = None  # the rollout engine's log-probs (mismatch correction)
    bapo_bounds: Tensor | None = None  # [2] fp32 (c_low, c_high) of the mini-batch (BAPO only)
    siren: Any = None  # megatron_rl.loss.siren.SirenTerm of this micro-batch (siren_coef > 0)
    teacher_logp: Tensor | None = None  # distillation teacher's log-probs (distill_loss_coef > 0)


@dataclass
class TokenLoss:
    """A policy loss before aggregation: per-token loss ``[B, T]`` and its metric records.

    ``premasked``: the loss is already +0 at padding (``~mask``) with its gradient masked alike,
    so the aggregation may skip its own padding mask (same values and gradients)."""

    loss: Tensor
    stats: dict[str, TokenStat] = field(default_factory=dict)
    premasked: bool = False


@dataclass
class LossOutput:
    """Result of :func:`megatron_rl.loss.compute.compute_loss` for one micro-batch.

    ``loss``: this micro-batch's share of the mini-batch loss (sum convention, see
    :mod:`megatron_rl.loss.context`). ``loss_for_backward`` = ``loss * ctx.grad_scale`` (what to
    back-propagate under DP gradient averaging). ``stats``: feed to a ``MetricAccumulator``.
    """

    loss: Tensor
    loss_for_backward: Tensor
    pg_loss: Tensor
    stats: dict[str, TokenStat]
