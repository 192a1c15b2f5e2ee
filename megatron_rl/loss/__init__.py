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

_WHERE = {  # public name -> its module in this package (imported on first use)
    "AGG_MODES": "config", "AdaptiveEntropyController": "entropy", "CovSelection": "cov",
    "KL_TYPES": "config", "LossConfig": "config", "LossConfigError": "config",
    "LossInputs": "types", "LossOutput": "types", "MetricAccumulator": "metrics",
    "PRESETS": "config", "PolicyLossSpec": "registry", "ReductionContext": "context",
    "TokenLoss": "types", "TokenStat": "metrics", "UnknownLossError": "registry",
    "aggregate": "aggregation", "aspo_per_token": "aspo", "assert_finite": "validation",
    "check_shapes": "validation", "compute_loss": "compute", "cov_stat_logp": "cov",
    "dcpo_bounds": "ppo", "default_dp_group": "context", "entropy_dynamics_diagnostic": "cov",
    "entropy_quantile_clip_width": "aspo", "entropy_ratio": "erc", "erc_gate": "erc",
    "erc_keep_mask": "erc", "get_policy_loss": "registry", "global_topk_mask": "select",
    "gradient_preserving_clip": "gppo", "kl_penalty": "kl", "kl_reward": "kl",
    "measured_entropy": "entropy", "nonfinite_fields": "validation",
    "policy_loss_names": "registry", "positive_token_mask": "gppo",
    "register_policy_loss": "registry", "select_cov_tokens": "cov", "token_covariance": "cov",
    "token_hash32": "select",
}


def __getattr__(name: str):
    """Import the module that defines ``name`` on first access: importing the package (as config
    loading does, for :class:`LossConfig`) costs no torch import."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


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
