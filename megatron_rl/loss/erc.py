"""ERC, entropy-ratio clipping, as a gate on any token-level policy loss (§9)."""

from __future__ import annotations

import torch

from megatron_rl.loss.metrics import TokenStat, mean_stat

Tensor = torch.Tensor


def entropy_ratio(entropy: Tensor, old_entropy: Tensor, eps: float = 1e-8) -> Tensor:
    """``[B, T]``: ``(H_new + eps) / (H_old + eps)`` (detached)."""
    return (entropy.detach().float() + eps) / (old_entropy.detach().float() + eps)


def erc_keep_mask(entropy: Tensor, old_entropy: Tensor, mask: Tensor, low: float, high: float
                  ) -> Tensor:
    """bool ``[B, T]``: valid tokens with ``low < rho < high`` (strict)."""
    rho = entropy_ratio(entropy, old_entropy)
    return (rho > low) & (rho < high) & mask.bool()


def erc_gate(token_loss: Tensor, keep: Tensor) -> Tensor:
    """``L_t`` where kept, ``sg(L_t)`` elsewhere: same forward value, zero gradient when gated."""
    return torch.where(keep, token_loss, token_loss.detach())


def erc_stats(entropy: Tensor, old_entropy: Tensor, keep: Tensor, mask: Tensor
              ) -> dict[str, TokenStat]:
    """Kept fraction, entropy-ratio min/mean/max, old and new mean entropy (global)."""
    m = mask.float()
    rho = entropy_ratio(entropy, old_entropy)
    return {"erc/kept_frac": mean_stat(keep.float(), m),
            "erc/entropy_ratio_min": TokenStat(rho, m, "min"),
            "erc/entropy_ratio_mean": mean_stat(rho, m),
            "erc/entropy_ratio_max": TokenStat(rho, m, "max"),
            "erc/old_entropy": mean_stat(old_entropy, m),
            "erc/new_entropy": mean_stat(entropy, m)}
