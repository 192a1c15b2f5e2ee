"""Policy losses with globally reduced statistics (ALGORITHMS.md §0-§12).

Typical use, once per mini-batch::

    ctx = ReductionContext.from_minibatch([mb.mask for mb in mbs])   # 1 all_gather over DP
    sel = select_cov_tokens(ctx, cfg, cov_stat_logp(cfg, olds, prepass), olds, advs, masks, step)
    acc = MetricAccumulator()
    for i, mb in enumerate(mbs):
        out = compute_loss(LossInputs(..., cov_selected=sel.selected[i]), cfg, ctx)
        out.loss_for_backward.backward()          # = loss * dp_size under DDP averaging
        acc.update(out.stats)
    metrics = {**acc.reduce(ctx), **sel.stats}     # 2 collectives
"""

from megatron_rl.loss.aggregation import aggregate
from megatron_rl.loss.aspo import aspo_per_token, entropy_quantile_clip_width
from megatron_rl.loss.compute import compute_loss
from megatron_rl.loss.config import AGG_MODES, KL_TYPES, PRESETS, LossConfig, LossConfigError
from megatron_rl.loss.context import ReductionContext, default_dp_group
from megatron_rl.loss.cov import (
    CovSelection,
    cov_stat_logp,
    entropy_dynamics_diagnostic,
    select_cov_tokens,
    token_covariance,
)
from megatron_rl.loss.entropy import AdaptiveEntropyController, measured_entropy
from megatron_rl.loss.erc import entropy_ratio, erc_gate, erc_keep_mask
from megatron_rl.loss.gppo import gradient_preserving_clip, positive_token_mask
from megatron_rl.loss.kl import kl_penalty, kl_reward
from megatron_rl.loss.metrics import MetricAccumulator, TokenStat
from megatron_rl.loss.ppo import dcpo_bounds
from megatron_rl.loss.registry import (
    PolicyLossSpec,
    UnknownLossError,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from megatron_rl.loss.select import global_topk_mask, token_hash32
from megatron_rl.loss.types import LossInputs, LossOutput, TokenLoss
from megatron_rl.loss.validation import assert_finite, check_shapes, nonfinite_fields

__all__ = [
    "AGG_MODES", "KL_TYPES", "PRESETS", "AdaptiveEntropyController", "CovSelection", "LossConfig",
    "LossConfigError", "LossInputs", "LossOutput", "MetricAccumulator", "PolicyLossSpec",
    "ReductionContext", "TokenLoss", "TokenStat", "UnknownLossError", "aggregate",
    "aspo_per_token", "assert_finite", "check_shapes", "compute_loss", "cov_stat_logp",
    "dcpo_bounds", "default_dp_group", "entropy_dynamics_diagnostic", "entropy_quantile_clip_width",
    "entropy_ratio", "erc_gate", "erc_keep_mask", "get_policy_loss", "global_topk_mask",
    "gradient_preserving_clip", "kl_penalty", "kl_reward", "measured_entropy",
    "nonfinite_fields", "policy_loss_names", "positive_token_mask", "register_policy_loss",
    "select_cov_tokens", "token_covariance", "token_hash32",
]
