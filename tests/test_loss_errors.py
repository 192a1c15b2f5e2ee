"""Bad input: clear errors naming the config field and allowed values, or documented zeros."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from megatron_rl.loss import (
    LossConfig,
    LossConfigError,
    LossInputs,
    MetricAccumulator,
    ReductionContext,
    UnknownLossError,
    assert_finite,
    check_shapes,
    compute_loss,
    get_policy_loss,
    kl_penalty,
    nonfinite_fields,
    policy_loss_names,
    select_cov_tokens,
)


def inputs(b=2, t=3, mask=None, **kw):
    mask = torch.ones(b, t, dtype=torch.bool) if mask is None else mask
    z = torch.zeros(b, t)
    return LossInputs(z.clone().requires_grad_(True), z, torch.ones(b, t), mask, **kw)


def test_unknown_loss_lists_valid_names():
    with pytest.raises(UnknownLossError) as e:
        LossConfig(policy_loss="ppo2").validate()
    msg = str(e.value)
    assert "policy_loss='ppo2'" in msg
    for name in policy_loss_names():
        assert name in msg
    with pytest.raises(ValueError):  # also a ValueError for generic config handling
        get_policy_loss("nope")


@pytest.mark.parametrize("field,value,allowed", [
    ("clip_ratio_low", -0.1, "[0, 1]"), ("clip_ratio_low", 1.5, "[0, 1]"),
    ("clip_ratio_high", -0.2, "[0, inf)"), ("clip_ratio_c", 1.0, "(1, inf)"),
    ("clip_ratio_low", float("nan"), "[0, 1]"),
    ("clip_cov_ratio", 0.0, "(0, 1]"), ("kl_cov_ratio", -1e-4, "(0, 1]"),
    ("kl_cov_ratio", 2.0, "(0, 1]"), ("loss_agg_mode", "mean", "token-mean"),
    ("kl_loss_type", "k4", "low_var_kl"), ("cov_stat_source", "fresh", "prepass"),
    ("aspo_c_neg", 0.5, "(1, inf)"), ("loss_scale_factor", 0.0, "(0, inf)")])
def test_out_of_range_config_names_field_and_allowed(field, value, allowed):
    with pytest.raises(LossConfigError) as e:
        LossConfig(**{field: value}).validate()
    assert field in str(e.value) and allowed in str(e.value)


def test_cispo_allows_large_lower_eps_and_erc_needs_token_level():
    LossConfig.for_algorithm("cispo").validate()
    with pytest.raises(LossConfigError, match="erc_low"):
        LossConfig(erc=True, erc_low=1.2).validate()
    with pytest.raises(LossConfigError, match="token-level"):
        LossConfig(policy_loss="gspo", erc=True).validate()
    with pytest.raises(LossConfigError, match="unknown LossConfig field"):
        LossConfig.for_algorithm("dapo", clip_ratio=0.3)
    with pytest.raises(LossConfigError, match="valid"):
        LossConfig.for_algorithm("grpo2")


def test_kl_type_error():
    with pytest.raises(LossConfigError, match="kl_loss_type"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k5")


def test_missing_inputs_are_named():
    ctx = ReductionContext.from_minibatch(torch.ones(2, 3, dtype=bool), group=None)
    with pytest.raises(ValueError, match="cov_selected"):
        compute_loss(inputs(), LossConfig(policy_loss="kl_cov"), ctx)
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(inputs(), LossConfig(policy_loss="aspo"), ctx)
    with pytest.raises(ValueError, match="old_entropy"):
        compute_loss(inputs(entropy=torch.ones(2, 3)), LossConfig(erc=True), ctx)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss(inputs(), LossConfig(use_kl_loss=True), ctx)
    with pytest.raises(ValueError, match="positive"):
        compute_loss(inputs(), LossConfig(policy_loss="gppo", positive_nll_coef=0.1), ctx)
    with pytest.raises(LossConfigError, match="prepass"):
        from megatron_rl.loss import cov_stat_logp
        cov_stat_logp(LossConfig(policy_loss="kl_cov"), torch.zeros(2, 3))


def test_nan_detection_is_opt_in_and_names_fields():
    inp = inputs()
    inp.advantages[0, 1] = float("nan")
    flags = nonfinite_fields(inp)  # device flags, no sync
    assert bool(flags["advantages"]) and not bool(flags["logp"])
    with pytest.raises(ValueError, match=r"\['advantages'\]"):
        assert_finite(inp)
    # NaN on padding is allowed
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    ok = inputs(mask=mask)
    ok.old_logp[0, 1] = float("nan")
    assert_finite(ok)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    out = compute_loss(ok, LossConfig(), ctx)
    assert torch.isfinite(out.loss)


def test_shape_errors():
    bad = inputs()
    bad.old_logp = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="old_logp"):
        check_shapes(bad)
    check_shapes(inputs())


@pytest.mark.parametrize("name", sorted(set(policy_loss_names())))
def test_empty_mask_gives_zero_loss_grad_and_metrics(name):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    cfg = LossConfig(policy_loss=name, use_kl_loss=True, entropy_coeff=0.1,
                     erc=get_policy_loss(name).token_level, positive_nll_coef=0.1)
    ctx = ReductionContext.from_minibatch(mask, group=None, extra_masks={"positive": [mask]})
    extra = dict(entropy=torch.ones(2, 3), old_entropy=torch.ones(2, 3),
                 ref_logp=torch.full((2, 3), -1.0), positive=torch.ones(2, dtype=torch.bool))
    stats = {}
    if name in ("clip_cov", "kl_cov"):
        sel = select_cov_tokens(ctx, cfg, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
                                mask)
        assert not sel.selected[0].any()
        extra["cov_selected"] = sel.selected[0]
        stats = sel.stats
    if name == "bapo":  # no token: the search stays at its start bounds, its sums are 0
        from megatron_rl.loss.bapo import bapo_bounds

        found = bapo_bounds(ctx, cfg, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
                            mask)
        torch.testing.assert_close(found.bounds, torch.tensor([0.6, 1.2]))
        extra["bapo_bounds"] = found.bounds
        stats = {k: found.stats[k] for k in ("bapo/pos_frac", "bapo/search_steps")}
    inp = inputs(mask=mask, **extra)
    out = compute_loss(inp, cfg, ctx)
    out.loss.backward()
    assert float(out.loss) == 0.0
    assert torch.equal(inp.logp.grad, torch.zeros(2, 3))
    acc = MetricAccumulator()
    acc.update(out.stats)
    for k, v in {**acc.reduce(ctx), **stats}.items():
        assert torch.isfinite(v), k
        if k != "entropy/coeff":
            assert float(v) == 0.0, k


def test_no_host_sync_calls_in_loss_package():
    root = pathlib.Path(__file__).resolve().parents[1] / "megatron_rl" / "loss"
    for f in root.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"\.item\(\)|\.cpu\(\)", text), f.name
        if f.name != "validation.py":  # assert_finite's one documented sync
            assert ".tolist()" not in text, f.name


def test_compute_loss_runs_without_host_sync():
    from megatron_rl.testing.device_spy import CountHostSyncs

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    cfg = LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.3, use_kl_loss=True, erc=True)
    inp = inputs(mask=mask, entropy=torch.ones(2, 3), old_entropy=torch.ones(2, 3),
                 ref_logp=torch.zeros(2, 3))
    with CountHostSyncs() as syncs:
        sel = select_cov_tokens(ctx, cfg, inp.logp, inp.old_logp, inp.advantages, mask)
        inp.cov_selected = sel.selected[0]
        out = compute_loss(inp, cfg, ctx)
        acc = MetricAccumulator()
        acc.update(out.stats)
        acc.reduce(ctx)
    assert syncs.n == 0
