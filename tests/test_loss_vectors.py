"""Every numeric test vector of ALGORITHMS.md (value AND gradient w.r.t. logp as a leaf)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.loss import (
    AdaptiveEntropyController,
    LossConfig,
    LossInputs,
    MetricAccumulator,
    ReductionContext,
    aggregate,
    compute_loss,
    dcpo_bounds,
    entropy_dynamics_diagnostic,
    entropy_quantile_clip_width,
    kl_penalty,
    kl_reward,
    measured_entropy,
    select_cov_tokens,
)

ATOL = 1e-6


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def run(cfg: LossConfig, logp, old, adv, mask=None, **extra):
    """Single process, one micro-batch: (loss, dloss/dlogp, metrics)."""
    logp = t([logp]).requires_grad_(True) if not isinstance(logp, torch.Tensor) else logp
    old = t([old]) if not isinstance(old, torch.Tensor) else old
    adv = t([adv]) if not isinstance(adv, torch.Tensor) else adv
    mask = torch.ones_like(adv, dtype=torch.bool) if mask is None else t([mask]).bool()
    cfg = cfg.validate()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    extra_stats = {}
    if cfg.policy_loss in ("clip_cov", "kl_cov"):
        sel = select_cov_tokens(ctx, cfg, logp.detach(), old, adv, mask, step=0)
        extra["cov_selected"] = sel.selected[0]
        extra_stats = sel.stats
    out = compute_loss(LossInputs(logp, old, adv, mask, **extra), cfg, ctx)
    out.loss.backward()
    acc = MetricAccumulator()
    acc.update(out.stats)
    return out.loss.detach(), logp.grad[0], {**acc.reduce(ctx), **extra_stats}


def close(a, b, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0)


# ---- §1 PPO dual clip -----------------------------------------------------------------------
def test_P1_ppo_dual_clip():
    r = [1.5, 0.5, 0.5, 4.0, 2.0, 10.0, 5.0]
    cfg = LossConfig(policy_loss="ppo", clip_ratio_c=3.0)
    loss, grad, m = run(cfg, [math.log(x) for x in r], [0.0] * 7, [1, 1, -1, -1, -1, 1, 0],
                        mask=[1, 1, 1, 1, 1, 0, 1])
    close(loss, 4.1 / 6)
    close(m["policy/clip_frac"], 2 / 6)
    close(m["policy/dual_clip_frac"], 1 / 6)
    close(m["policy/ppo_kl"], -0.451342)
    close(grad, [0, -1 / 12, 0, 0, 1 / 3, 0, 0])
    close(m["policy/ratio_max"], 5.0, atol=1e-5)
    close(m["policy/ratio_min"], 0.5)


# ---- §2 DAPO --------------------------------------------------------------------------------
def test_D1_clip_higher():
    r = [1.25, 1.4, 0.75, 0.5]
    cfg = LossConfig.for_algorithm("dapo")
    loss, grad, _ = run(cfg, [math.log(x) for x in r], [0.0] * 4, [1, 1, -1, 1])
    close(loss, -0.5575)
    close(grad, [-0.3125, 0, 0, -0.125])


@pytest.mark.parametrize("mode,scale,expected", [
    ("token-mean", None, 1.75), ("seq-mean-token-mean", None, 2.5),
    ("seq-mean-token-sum", None, 3.5), ("seq-mean-token-sum-norm", 4.0, 0.875),
    ("token-sum-norm", 4.0, 1.75)])
def test_D2_aggregation(mode, scale, expected):
    values = t([[4.0, 99.0, float("nan")], [1.0, 1.0, 1.0]]).requires_grad_(True)
    mask = t([[1, 0, 0], [1, 1, 1]]).bool()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    out = aggregate(values, mask, mode, ctx, scale)
    close(out, expected)
    out.backward()
    assert values.grad[0, 1] == 0 and values.grad[0, 2] == 0  # padding gets no gradient


def test_D2_default_scale_is_global_max_len():
    mask = t([[1, 0, 0], [1, 1, 1]]).bool()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    close(aggregate(t([[4.0, 0, 0], [1, 1, 1]]), mask, "token-sum-norm", ctx), 7 / 3)


# ---- §4 Clip-Cov / KL-Cov -------------------------------------------------------------------
COV_A = [3, 3, 1, 1, -2, -2, -4, 0]
COV_LOGP = [-1, -3, -1, -3, -1, -3, -2, -2]


def test_cov_values():
    ctx = ReductionContext.from_minibatch(torch.ones(1, 8, dtype=torch.bool), group=None)
    from megatron_rl.loss import token_covariance
    cov, batch = token_covariance(ctx, t([COV_LOGP]), t([COV_A]), torch.ones(1, 8, dtype=bool))
    close(cov[0][0], [3, -3, 1, -1, -2, 2, 0, 0])
    close(batch, 0.0)


def test_C1_clip_cov_deterministic():
    cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.25)
    loss, grad, m = run(cfg, list(map(float, COV_LOGP)), list(map(float, COV_LOGP)), COV_A)
    close(loss, 0.125)
    close(m["clip_cov/zeroed_frac"], 0.25)
    close(m["clip_cov/selected_frac"], 0.25)
    close(grad, [0, -0.375, -0.125, -0.125, 0.25, 0, 0.5, 0])


def test_C2_clip_cov_default_ratio_picks_exactly_one():
    cfg = LossConfig(policy_loss="clip_cov")
    picked = set()
    for step in range(16):
        ctx = ReductionContext.from_minibatch(torch.ones(1, 8, dtype=torch.bool), group=None)
        sel = select_cov_tokens(ctx, cfg, t([COV_LOGP]), t([COV_LOGP]), t([COV_A]),
                                torch.ones(1, 8, dtype=bool), step=step).selected[0][0]
        assert int(sel.sum()) == 1
        idx = int(sel.nonzero()[0, 0])
        assert idx in (0, 5)
        picked.add(idx)
    assert picked == {0, 5}  # the hash really varies with the step


def test_C3_clip_cov_excludes_ppo_clipped():
    old = list(map(float, COV_LOGP))
    old[0] = -1 - math.log(1.5)
    cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.25)
    loss, grad, m = run(cfg, list(map(float, COV_LOGP)), old, COV_A)
    close(loss, -0.325)
    close(m["clip_cov/zeroed_frac"], 0.125)
    close(grad * 8, [0, -3, -1, -1, 2, 0, 4, 0])


def test_K1_kl_cov():
    old = list(map(float, COV_LOGP))
    old[0] = -1 - math.log(1.5)
    old[5] = -3 + math.log(2)
    cfg = LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.25, kl_cov_coef=1.0)
    loss, grad, m = run(cfg, list(map(float, COV_LOGP)), old, COV_A)
    close(loss, -0.175173)
    close(m["policy/abs_log_ratio"], 0.137327)
    close(grad * 8, [-3.5, -3, -1, -1, 2, 0, 4, 0], atol=1e-5)
    close(m["kl_cov/penalised_frac"], 0.25)


# ---- §5 GSPO --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_G1_gspo(name):
    logp = t([[0.2, 0.0, 0.0, 0.0], [1e-4, -1e-4, 2e-4, 2e-4]], torch.float64)
    cfg = LossConfig.for_algorithm(name)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    adv = t([[1.0] * 4, [-1.0] * 4])
    ctx = ReductionContext.from_minibatch(mask, group=None)
    lp = logp.float().requires_grad_(True)
    out = compute_loss(LossInputs(lp, torch.zeros(2, 4), adv, mask), cfg, ctx)
    out.loss.backward()
    acc = MetricAccumulator()
    acc.update(out.stats)
    m = acc.reduce(ctx)
    close(out.loss, -0.000149998, atol=1e-7)  # fp32 inputs: 1e-9 is below fp32 resolution here
    close(m["policy/clip_frac"], 2 / 6)
    close(m["gspo/seq_ratio_max"], 1.105171)
    close(m["gspo/seq_ratio_min"], 1.000100005)
    close(lp.grad[0], [0, 0, 0, 0])
    close(lp.grad[1], [0.125013] * 4)


def test_G1_gspo_fp64_tolerance():
    # the spec's 1e-9 tolerance, checked with float64 inputs
    logp = t([[0.2, 0.0, 0.0, 0.0], [1e-4, -1e-4, 2e-4, 2e-4]], torch.float64)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    cfg = LossConfig.for_algorithm("gspo")
    out = compute_loss(LossInputs(logp, torch.zeros(2, 4, dtype=torch.float64),
                                  t([[1.0] * 4, [-1.0] * 4], torch.float64), mask), cfg, ctx)
    close(out.loss, -0.000149998, atol=1e-9)


# ---- §6 CISPO -------------------------------------------------------------------------------
def test_X1_cispo():
    cfg = LossConfig.for_algorithm("cispo")
    loss, grad, m = run(cfg, [math.log(0.5), math.log(0.2), math.log(0.55)],
                        [math.log(0.25), math.log(0.4), math.log(0.5)], [1, -1, 1])
    close(loss, 0.228226)
    close(grad * 3, [-1.2, 0.5, -1.1])
    close(m["policy/clip_frac"], 1 / 3)


# ---- §7 GPPO --------------------------------------------------------------------------------
GP_R = [1.5, 0.5, 0.5, 2.0, 12.0]
GP_A = [1, -1, 1, -1, -1]


def test_GP1_gppo():
    cfg = LossConfig(policy_loss="gppo", clip_ratio_high=0.28, clip_ratio_c=10.0)
    loss, grad, _ = run(cfg, [math.log(x) for x in GP_R], [0.0] * 5, GP_A)
    close(loss, 2.204, atol=1e-5)
    close(grad * 5, [-1.28, 0.8, -0.5, 2.0, 0], atol=1e-5)


def test_GP1_dapo_gradient_for_contrast():
    cfg = LossConfig(policy_loss="dapo", clip_ratio_high=0.28, clip_ratio_c=10.0)
    loss, grad, _ = run(cfg, [math.log(x) for x in GP_R], [0.0] * 5, GP_A)
    close(loss, 2.204, atol=1e-5)
    close(grad * 5, [0, 0, -0.5, 2.0, 0], atol=1e-5)


def test_gppo_positive_nll_uses_global_positive_token_count():
    cfg = LossConfig(policy_loss="gppo", positive_nll_coef=0.1)
    logp = t([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 1, 1]]).bool()
    positive = t([True, False], torch.bool)
    ctx = ReductionContext.from_minibatch(mask, group=None,
                                          extra_masks={"positive": [mask & positive[:, None]]})
    zero = torch.zeros(2, 3)
    out = compute_loss(LossInputs(logp, logp.detach(), zero, mask, positive=positive), cfg, ctx)
    out.loss.backward()
    close(out.loss, 0.1 * 1.5)  # PG term is 0 (A = 0); NLL = (1 + 2) / 2 positive tokens
    close(logp.grad, [[-0.05, -0.05, 0], [0, 0, 0]])


# ---- §8 ASPO --------------------------------------------------------------------------------
AS_OLD = [0.5, 0.4, 0.4, 0.5, 0.2, 0.1]
AS_NEW = [0.4, 0.6, 0.1, 0.25, 0.4, 0.4]
AS_A = [1, 1, 1, -1, -1, -1]


@pytest.mark.parametrize("eps,expected", [
    (0.2, [-1.25, -0.833333, 6.907755, 0.8, 2.0, -2.748872]),
    (0.4, [-1.25, -0.714286, 6.907755, 0.6, 2.0, -2.748872])])
def test_AS1_aspo(eps, expected):
    cfg = LossConfig(policy_loss="aspo", aspo_eps_low_entropy=eps, aspo_eps_high_entropy=eps)
    loss, grad, m = run(cfg, [math.log(x) for x in AS_NEW], [math.log(x) for x in AS_OLD], AS_A,
                        entropy=torch.ones(1, 6))
    close(loss, sum(expected) / 6)
    if eps == 0.2:
        close(loss, 0.812592)
    close(grad * 6, [-1.25, 0, -3, 0, 2, 3], atol=1e-5)
    close(m["aspo/clip_frac_upper"], 1 / 6)
    close(m["aspo/clip_frac_lower"], 1 / 6)
    close(m["aspo/pos_dual_clip_frac"], 1 / 3)
    close(m["aspo/neg_dual_clip_frac"], 1 / 3)


def test_AS1_entropy_quantile_widths():
    h = t([[0.1, 0.2, 0.3, 0.4, 5.0]])
    eps = entropy_quantile_clip_width(h, torch.ones(1, 5, dtype=bool), 0.8, 0.2, 0.4)
    close(eps, [[0.2, 0.2, 0.2, 0.2, 0.4]])
    q = torch.quantile(h[0], 0.8)
    close(q, 1.32)


# ---- §9 ERC ---------------------------------------------------------------------------------
def test_E1_erc_on_dapo():
    r = [1.5, 1.1, 0.9, 1.1]
    h_old, h_new = t([[1.0, 1.0, 2.0, 0.5]]), t([[1.02, 1.10, 1.8, 0.51]])
    cfg = LossConfig.for_algorithm("dapo", erc=True)
    loss, grad, m = run(cfg, [math.log(x) for x in r], [0.0] * 4, [1, 1, -1, -1],
                        entropy=h_new, old_entropy=h_old)
    close(loss, -0.095)
    close(grad * 4, [0, 0, 0, 1.1])
    close(m["erc/kept_frac"], 0.5)
    close(m["erc/entropy_ratio_max"], 1.1)
    close(m["erc/entropy_ratio_min"], 0.9)
    _, grad_no_erc, _ = run(LossConfig.for_algorithm("dapo"), [math.log(x) for x in r],
                            [0.0] * 4, [1, 1, -1, -1])
    close(grad_no_erc * 4, [0, -1.1, 0.9, 1.1])


# ---- §10 Skywork-OR1 controller, DCPO bounds -------------------------------------------------
def test_S1_adaptive_entropy_controller():
    ctl = AdaptiveEntropyController(target=0.2, delta=1e-4, c_max=5e-3)
    used, after = [], []
    for e in [0.25, 0.15, 0.15, 0.3, 0.1]:
        used.append(float(ctl.alpha))
        ctl.update(e)
        after.append((float(ctl.coeff), float(ctl.enabled)))
    used.append(float(ctl.alpha))
    close(used, [0, 0, 1e-4, 2e-4, 0, 2e-4], atol=1e-12)
    close([a for a, _ in after], [0, 1e-4, 2e-4, 1e-4, 2e-4], atol=1e-12)
    assert [b for _, b in after] == [0, 1, 1, 0, 1]
    state = ctl.state_dict()
    other = AdaptiveEntropyController()
    other.load_state_dict(state)
    assert float(other.alpha) == float(ctl.alpha)
    for _ in range(60):
        ctl.update(torch.tensor(0.1))
    close(ctl.coeff, 5e-3, atol=1e-12)


def test_S1_measured_entropy_and_coeff_in_loss():
    old = t([[-0.1, -0.3, -9.0]])
    mask = t([[1, 1, 0]]).bool()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    close(measured_entropy(old, mask, ctx), 0.2)
    ent = t([[1.0, 3.0, 5.0]]).requires_grad_(True)
    zero = torch.zeros(1, 3)
    out = compute_loss(LossInputs(zero, zero, zero, mask, entropy=ent), LossConfig(), ctx,
                       entropy_coeff=torch.tensor(0.5, dtype=torch.float64))
    out.loss.backward()
    close(out.loss, -0.5 * 2.0)
    close(ent.grad, [[-0.25, -0.25, 0]])


@pytest.mark.parametrize("q,low,high", [
    (1.0, 0.723607, 1.228011), (0.9, 0.666667, 1.249074), (0.5, 0.5, 1.4),
    (0.1, 0.5, 2.246425), (0.01, 0.5, 5.815073), (0.001, 0.5, 10.0)])
def test_DC1_dcpo_bounds(q, low, high):
    lo, hi = dcpo_bounds(t([math.log(q)]), 0.2, 0.28, 10.0)
    close(lo[0], low)
    close(hi[0], high, atol=2e-6)


def test_dcpo_loss_uses_bounds():
    # q = 0.5 -> bounds [0.5, 1.4]: r = 1.3 (A > 0) unclipped, r = 1.5 (A > 0) clipped at 1.4
    cfg = LossConfig.for_algorithm("dcpo")
    old = [math.log(0.5)] * 2
    loss, grad, _ = run(cfg, [old[0] + math.log(1.3), old[0] + math.log(1.5)], old, [1, 1])
    close(loss, -(1.3 + 1.4) / 2)
    close(grad, [-1.3 / 2, 0])


# ---- §11 KL ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,rows", [
    ("k1", [(0.693147, 1.0), (-0.693147, 1.0)]),
    ("k2", [(0.240227, 0.693147), (0.240227, -0.693147)]),
    ("k3", [(0.193147, 0.5), (0.306853, -1.0)]),
    ("low_var_kl", [(0.193147, 0.5), (0.306853, -1.0)]),
    ("k3+", [(0.193147, 0.693147), (0.306853, -0.693147)]),
    ("abs", [(0.693147, 1.0), (0.693147, -1.0)]),
    ("abs+", [(0.693147, 0.693147), (0.693147, -0.693147)]),
    ("k1+", [(0.693147, 0.693147), (-0.693147, -0.693147)])])
def test_KL1_estimators(kind, rows):
    logp = t([math.log(0.5), math.log(0.25)]).requires_grad_(True)
    ref = t([math.log(0.25), math.log(0.5)])
    val = kl_penalty(logp, ref, kind)
    val.sum().backward()
    close(val, [r[0] for r in rows])
    close(logp.grad, [r[1] for r in rows])


def test_KL1_k3_clamped():
    logp = t([-30.0, 0.0]).requires_grad_(True)
    val = kl_penalty(logp, t([0.0, -30.0]), "k3")
    val.sum().backward()
    close(val, [10.0, 10.0])
    close(logp.grad, [0.0, 0.0])


def test_kl_as_loss_term_and_reward_term():
    mask = t([[1, 1, 0]]).bool()
    logp = t([[math.log(0.5), math.log(0.25), 0.0]]).requires_grad_(True)
    ref = t([[math.log(0.25), math.log(0.5), 3.0]])
    ctx = ReductionContext.from_minibatch(mask, group=None)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    zero = torch.zeros(1, 3)
    out = compute_loss(LossInputs(logp, logp.detach(), zero, mask, ref_logp=ref), cfg, ctx)
    out.loss.backward()
    close(out.loss, 0.0)  # k1 values +-0.693 cancel
    close(logp.grad, [[0.25, 0.25, 0]])
    rewards, kl = kl_reward(t([[0.0, 0.0, 0.0]]), logp.detach(), ref, mask, 0.1, "k1")
    close(rewards, [[-0.0693147, 0.0693147, 0]])


# ---- §12 entropy dynamics -------------------------------------------------------------------
@pytest.mark.parametrize("adv,cov,pred_nat,exact_nat,pred_van,exact_van", [
    ([0, 0, 1], 0.173287, -0.00173287, -0.00174535, -0.00086643, -0.00086956),
    ([1, 0, 0], -0.086643, 0.00086643, 0.00085919, 0.00021661, 0.00021616)])
def test_T1_entropy_dynamics_theory(adv, cov, pred_nat, exact_nat, pred_van, exact_van):
    from megatron_rl.loss.diagnostics import (
        entropy_change,
        predicted_entropy_change,
        softmax_cov,
    )
    z = torch.tensor([0.0, 0.0, math.log(2)], dtype=torch.float64)
    a = torch.tensor(adv, dtype=torch.float64)
    eta = 0.01
    close(softmax_cov(z, a), cov)
    pi = torch.softmax(z, -1)
    for dz, pred, exact in ((eta * a, pred_nat, exact_nat), (eta * pi * a, pred_van, exact_van)):
        p = predicted_entropy_change(z, dz)
        e = entropy_change(z, dz)
        close(p, pred, atol=1e-8)
        close(e, exact, atol=1e-8)
        assert math.copysign(1, float(p)) == math.copysign(1, float(e))
        torch.testing.assert_close(p, e, rtol=2e-2, atol=0)


def test_entropy_dynamics_diagnostic_single_process():
    mask = torch.ones(1, 8, dtype=torch.bool)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    d = entropy_dynamics_diagnostic(ctx, t([COV_LOGP]), t([COV_A]), mask, top_frac=0.25)
    close(d["entropy_dynamics/batch_cov"], 0.0)
    close(d["entropy_dynamics/cov_mean_top"], (3 + 2) / 2)
    close(d["entropy_dynamics/top_count"], 2)
