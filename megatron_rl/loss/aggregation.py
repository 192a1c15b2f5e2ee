"""Loss aggregation over tokens with global denominators (ALGORITHMS.md §0).

Each mode returns this micro-batch's share ``sum(local contributions) / global denominator``; the
shares of all micro-batches and DP ranks add up to the mode's value on the whole mini-batch.
"""

from __future__ import annotations

import torch

from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.masking import masked_zero
from megatron_rl.loss.params import AGG_MODES, LossConfigError

Tensor = torch.Tensor


def masked_sum_rows(values: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` per-sequence sums of ``values`` over valid tokens (padding values are ignored)."""
    return masked_zero(values, mask.bool()).sum(-1)


def aggregate(values: Tensor, mask: Tensor, mode: str, ctx: ReductionContext,
              scale_factor: float | None = None, premasked: bool = False) -> Tensor:
    """Aggregate per-token ``values [B, T]`` (fp32) to this micro-batch's 0-dim share.

    * ``token-mean``: Σ m·L / N_tokens(global).
    * ``seq-mean-token-mean``: Σ_i (Σ_t m·L / Σ_t m) / N_seqs(global, non-empty).
    * ``seq-mean-token-sum``: Σ_i Σ_t m·L / N_seqs.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO reference): Σ_i (Σ_t m·L / C) / N_seqs.
    * ``token-sum-norm`` (verl's variant of the former): Σ m·L / C, no division by N_seqs.

    ``C`` is ``scale_factor`` or, when None, the global max padded length (set it explicitly, e.g.
    to the max response length, when padding differs between layouts). Runs set it: a run config
    gives the ``*-sum-norm`` modes ``loss_scale_factor = rollout.max_new_tokens`` (Dr.GRPO's
    constant, ALGORITHMS.md §3.2; :func:`megatron_rl.config.checks.dr_grpo_constant`).
    ``premasked``: ``values`` are already +0 at padding (gradient too), no mask is applied.
    """
    m = mask.bool()
    if mode == "seq-mean-token-mean":
        seq_sum = values.sum(-1) if premasked else masked_sum_rows(values, m)
        seq_tokens = m.sum(-1).clamp_min(1).to(values.dtype)
        return (seq_sum / seq_tokens).sum() / ctx.seq_denominator
    if mode not in AGG_MODES:
        raise LossConfigError(f"loss_agg_mode={mode!r} is not valid; allowed: {list(AGG_MODES)}")
    total = values.sum() if premasked else masked_zero(values, m).sum()
    if mode == "token-mean":
        return total / ctx.token_denominator
    if mode == "seq-mean-token-sum":
        return total / ctx.seq_denominator
    c = ctx.max_len.to(values.dtype) if scale_factor is None else float(scale_factor)
    if mode == "seq-mean-token-sum-norm":
        return total / c / ctx.seq_denominator
    return total / c  # token-sum-norm
