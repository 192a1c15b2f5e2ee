"""The clipped value loss of PPO, with verl's ``compute_value_loss`` semantics
(``verl/trainer/ppo/core_algos.py``)::

    vpred_clipped = clip(vpred, old_values - cliprange_value, old_values + cliprange_value)
    loss          = 0.5 * agg(max((vpred - returns)^2, (vpred_clipped - returns)^2), mask)
    clipfrac      = masked_mean((vpred_clipped - returns)^2 > (vpred - returns)^2)

Aggregation here is token-mean over the whole mini-batch (all micro-batches and DP ranks: the
global valid-token count of a :class:`~megatron_rl.loss.context.ReductionContext`), so the gradient
does not depend on the micro-batch or DP split.
"""

from __future__ import annotations

import torch


def clipped_value_terms(vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(max of the two squared errors, clipped-is-larger indicator)``, ``[B, S]``."""
    clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    l1 = (vpred - returns) ** 2
    l2 = (clipped - returns) ** 2
    return torch.maximum(l1, l2), (l2 > l1).float()


def value_loss_token_mean(vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                          mask: torch.Tensor, cliprange_value: float, denominator: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the mini-batch loss ``0.5 * sum(loss * mask) / denominator``
    and of the clip fraction (sum over its masked tokens / denominator)."""
    m = mask.float()
    per_tok, clip = clipped_value_terms(vpred, old_values, returns, cliprange_value)
    return 0.5 * (per_tok * m).sum() / denominator, (clip * m).sum() / denominator
