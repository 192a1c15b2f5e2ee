"""Entropy-dynamics theory helpers (§12) for one softmax state; used by tests and notebooks.

The batch-level diagnostic that training logs lives in :mod:`megatron_rl.loss.cov`
(:func:`~megatron_rl.loss.cov.entropy_dynamics_diagnostic`).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def softmax_entropy(logits: Tensor) -> Tensor:
    """Shannon entropy of ``softmax(logits)`` over the last dim."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def softmax_cov(logits: Tensor, values: Tensor) -> Tensor:
    """``Cov_{a ~ pi}(log pi(a), values(a))`` with ``pi = softmax(logits)``."""
    logp = torch.log_softmax(logits, -1)
    pi = logp.exp()
    return (pi * logp * values).sum(-1) - (pi * logp).sum(-1) * (pi * values).sum(-1)


def predicted_entropy_change(logits: Tensor, delta_logits: Tensor) -> Tensor:
    """First-order ``H(z + dz) - H(z) ~ -Cov(log pi, dz)`` (§12)."""
    return -softmax_cov(logits, delta_logits)


def entropy_change(logits: Tensor, delta_logits: Tensor) -> Tensor:
    """Exact ``H(z + dz) - H(z)``."""
    return softmax_entropy(logits + delta_logits) - softmax_entropy(logits)
