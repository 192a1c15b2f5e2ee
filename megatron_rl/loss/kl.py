"""KL estimators k1 / k2 / k3 (low_var_kl) / abs and the straight-through "+" variants (§11),
as a loss term and as a reward term."""

from __future__ import annotations

import torch

from megatron_rl.loss.params import KL_TYPES, LossConfigError

Tensor = torch.Tensor

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _base_kl(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    delta = logp - ref_logp
    if kind == "k1":
        return delta
    if kind == "abs":
        return delta.abs()
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "k3":
        k = (ref_logp - logp).clamp(-20.0, 20.0)
        return (torch.exp(k) - k - 1.0).clamp(-10.0, 10.0)
    raise AssertionError(kind)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate ``[B, T]`` of ``logp`` against the reference (gradient w.r.t. logp).

    ``k1``/``kl``: δ; ``abs``: |δ|; ``k2``/``mse``: δ²/2; ``k3``/``low_var_kl``:
    ``clamp(e^k - k - 1, -10, 10)`` with ``k = clamp(ref - logp, -20, 20)``; δ = logp - ref.
    A ``+`` suffix keeps the value but uses the k2 gradient δ (straight-through); ``k2+`` = k2.
    """
    if kl_type not in KL_TYPES:
        raise LossConfigError(f"kl_loss_type={kl_type!r} is not valid; allowed: {list(KL_TYPES)}")
    straight_through = kl_type.endswith("+")
    kind = kl_type.rstrip("+")
    kind = _ALIASES.get(kind, kind)
    value = _base_kl(logp, ref_logp, kind)
    if not straight_through or kind == "k2":
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()


def kl_reward(token_scores: Tensor, old_logp: Tensor, ref_logp: Tensor, mask: Tensor,
              coef: float, kl_type: str = "k1") -> tuple[Tensor, Tensor]:
    """KL in the reward (§11): ``token_scores - coef * KL(old_logp, ref_logp)`` on valid tokens.

    Returns ``(token_rewards [B, T], kl [B, T])``, both constants (no gradient).
    """
    kl = kl_penalty(old_logp.detach(), ref_logp.detach(), kl_type).detach() * mask.float()
    return token_scores - coef * kl, kl
