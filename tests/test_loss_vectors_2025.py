"""GMPO, SAPO, DPPO-TV, DPPO-KL against an independent float64 re-derivation (value AND gradient).

The expected numbers are computed here with plain Python floats and ``math`` from the papers'
formulas (docs/losses-2025.md), never by calling ``megatron_rl.loss``. Gradients are with respect
to ``logp`` as a leaf, aggregated with each ``loss_agg_mode``'s weights. The vectors put ratios just
inside and just outside every bound, use advantages of both signs and exact zeros, and masks with
interior holes (holding garbage that must be ignored) and one empty sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.loss import AGG_MODES, LossConfig, LossInputs, MetricAccumulator, compute_loss
from megatron_rl.loss import ReductionContext as Ctx

ATOL = 1e-9
MATOL = 1e-6  # metrics are reduced to fp32
C_NORM = 5.0  # loss_scale_factor of the *-sum-norm modes
NAN = float("nan")


def agg_weights(mask: list[list[int]], mode: str) -> list[list[float]]:
    """Per-token weight W with loss = sum W * L for each aggregation mode (by hand)."""
    n_tok = sum(map(sum, mask))
    n_seq = sum(1 for row in mask if sum(row) > 0)
    out = []
    for row in mask:
        n = sum(row)
        w = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (max(n, 1) * n_seq),
             "seq-mean-token-sum": 1 / n_seq, "seq-mean-token-sum-norm": 1 / (C_NORM * n_seq),
             "token-sum-norm": 1 / C_NORM}[mode]
        out.append([w * m for m in row])
    return out


def run(cfg: LossConfig, logp, old, adv, mask, rollout=None):
    """compute_loss on float64 inputs: (loss, dloss/dlogp, metrics)."""
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    m = torch.tensor(mask, dtype=torch.bool)
    ctx = Ctx.from_minibatch(m, group=None)
    inp = LossInputs(lp, torch.tensor(old, dtype=torch.float64),
                     torch.tensor(adv, dtype=torch.float64), m,
                     rollout_logp=None if rollout is None else torch.tensor(rollout,
                                                                            dtype=torch.float64))
    out = compute_loss(inp, cfg.validate(), ctx)
    out.loss.backward()
    acc = MetricAccumulator()
    acc.update(out.stats)
    metrics = {k: float(v) for k, v in acc.reduce(ctx).items()}
    return float(out.loss.detach()), lp.grad.tolist(), metrics


def close(got, want, atol=ATOL):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), atol=atol, rtol=0)


def token_level_expected(values, grads, mask, mode):
    """Aggregate per-token (value, dvalue/dlogp) of a token-level loss."""
    w = agg_weights(mask, mode)
    loss = sum(w[i][t] * values[i][t] for i in range(len(mask)) for t in range(len(mask[i])))
    return loss, [[w[i][t] * grads[i][t] for t in range(len(row))] for i, row in enumerate(mask)]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---- GMPO -----------------------------------------------------------------------------------
# eps = 0.4 in log space. d = logp - old; holes carry garbage.
GM_D = [[0.39, 0.41, 5.0, -0.5, 0.0],     # A_i = +1 (mean of [1, 1, ., 0.5, 1.5])
        [-0.39, 9.0, -0.41, 0.5, NAN],    # A_i = -0.5
        [1.0, 2.0, -3.0, 0.0, 0.0],       # A_i = 0 exactly
        [NAN, NAN, NAN, NAN, NAN]]        # empty sequence
GM_A = [[1.0, 1.0, 99.0, 0.5, 1.5], [-0.5, -0.5, -0.5, -0.5, -0.5], [0.0] * 5, [7.0] * 5]
GM_M = [[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0] * 5]
GM_OLD = [[-1.0, -0.7, -2.0, -0.3, -1.2], [-0.9, -1.1, -0.8, -1.5, 0.0],
          [-0.2, -2.5, -0.1, 0.0, 0.0], [0.0] * 5]


def gmpo_reference(d, adv, mask, lo=0.4, hi=0.4):
    """Per sequence: (L_i, dL_i/dlogp_t for each t), from the paper's clipped geometric mean."""
    seqs = []
    for di, ai, mi in zip(d, adv, mask, strict=True):
        idx = [t for t, m in enumerate(mi) if m]
        if not idx:
            seqs.append((0.0, [0.0] * len(mi)))
            continue
        a = sum(ai[t] for t in idx) / len(idx)
        c, live = {}, {}
        for t in idx:
            x = di[t]
            if a > 0:   # min(x, clip(x)): clipped (constant) only above hi
                c[t], live[t] = (hi, False) if x > hi else (x, True)
            elif a < 0:  # max(x, clip(x)): clipped only below -lo
                c[t], live[t] = (-lo, False) if x < -lo else (x, True)
            else:
                c[t], live[t] = x, True
        s = math.exp(sum(c.values()) / len(idx))
        g = [(-a * s / len(idx) if t in live and live[t] else 0.0) for t in range(len(mi))]
        seqs.append((-a * s, g))
    return seqs


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gmpo_vector_every_aggregation(mode):
    cfg = LossConfig.for_algorithm("gmpo", loss_agg_mode=mode, loss_scale_factor=C_NORM)
    logp = [[o + x for o, x in zip(orow, drow, strict=True)] for orow, drow in zip(GM_OLD, GM_D,
                                                                                strict=True)]
    loss, grad, m = run(cfg, logp, GM_OLD, GM_A, GM_M)
    w = agg_weights(GM_M, mode)
    ref = gmpo_reference(GM_D, GM_A, GM_M)
    want_loss = sum(sum(w[i]) * ref[i][0] for i in range(4))
    want_grad = [[sum(w[i]) * g for g in ref[i][1]] for i in range(4)]
    close(loss, want_loss)
    close(grad, want_grad)
    # two clipped tokens (0.41 with A > 0, -0.41 with A < 0) of 10 valid ones
    close(m["policy/clip_frac"], 0.2, MATOL)
    close(m["policy/clip_frac_upper"], 0.1, MATOL)
    close(m["policy/clip_frac_lower"], 0.1, MATOL)
    close(m["gmpo/seq_ratio_max"], math.exp((0.39 + 0.4 - 0.5) / 4), MATOL)
    if mode == "seq-mean-token-mean":  # the paper's mean over (non-empty) sequences, by hand
        s0, s1 = math.exp(0.29 / 4), math.exp((-0.39 - 0.4 + 0.5) / 3)
        close(loss, (-s0 + 0.5 * s1 + 0.0) / 3)
        close(grad[0], [-s0 / 12, 0, 0, -s0 / 12, -s0 / 12])
        close(grad[1], [0.5 * s1 / 9, 0, 0, 0.5 * s1 / 9, 0])


def test_gmpo_is_not_the_arithmetic_mean():
    """Negative control: a GRPO-style token mean of clipped ratios gives a different loss."""
    cfg = LossConfig.for_algorithm("gmpo")
    d = [[0.3, -0.3]]
    loss, _, _ = run(cfg, d, [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]])
    close(loss, -1.0)  # exp(mean(0.3, -0.3)) = 1
    assert abs(loss - -(math.exp(0.3) + math.exp(-0.3)) / 2) > 1e-2


def test_gmpo_rejects_erc_and_uses_paper_defaults():
    cfg = LossConfig.for_algorithm("gmpo")
    assert (cfg.gmpo_clip_low, cfg.gmpo_clip_high) == (0.4, 0.4)
    assert cfg.loss_agg_mode == "seq-mean-token-mean"
    from megatron_rl.loss import LossConfigError
    with pytest.raises(LossConfigError, match="token-level"):
        LossConfig(policy_loss="gmpo", erc=True).validate()


# ---- SAPO -----------------------------------------------------------------------------------
SA_R = [[0.5, 0.99, 1.0, 1.01, 2.0], [1.0, 30.0, 0.8, 1.3, 4.0]]
SA_A = [[1.0, 1.0, -1.0, -1.0, 0.0], [0.0, 2.0, -0.5, 0.7, -1.5]]
SA_M = [[1, 1, 1, 1, 1], [1, 0, 1, 1, 1]]   # hole with r = 30


def sapo_reference(r, a, tau_pos, tau_neg):
    """(value, dvalue/dlogp) per token: f = sigma(tau (r-1)) 4/tau, df/dlogp = 4 s (1-s) r."""
    tau = tau_pos if a > 0 else tau_neg
    s = sigmoid(tau * (r - 1))
    return -a * s * 4 / tau, -a * 4 * s * (1 - s) * r


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 8.0)])
def test_sapo_vector_every_aggregation(mode, taus):
    cfg = LossConfig.for_algorithm("sapo", loss_agg_mode=mode, loss_scale_factor=C_NORM,
                                   sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    old = [[-1.0] * 5, [-2.0] * 5]
    logp = [[o + math.log(r) for o, r in zip(orow, rrow, strict=True)]
            for orow, rrow in zip(old, SA_R, strict=True)]
    loss, grad, m = run(cfg, logp, old, SA_A, SA_M)
    vals = [[sapo_reference(r, a, *taus)[0] for r, a in zip(rr, aa, strict=True)]
            for rr, aa in zip(SA_R, SA_A, strict=True)]
    grads = [[sapo_reference(r, a, *taus)[1] for r, a in zip(rr, aa, strict=True)]
             for rr, aa in zip(SA_R, SA_A, strict=True)]
    want_loss, want_grad = token_level_expected(vals, grads, SA_M, mode)
    close(loss, want_loss)
    close(grad, want_grad)
    assert grad[1][1] == 0.0 and grad[0][4] == 0.0 and grad[1][0] == 0.0  # hole, A = 0


def test_sapo_gradient_shape_is_a_soft_gate():
    """SAPO's point: weight 1 on-policy, smooth decay, never a hard zero; tau sets the width."""
    def weight(r: float, tau: float) -> float:
        cfg = LossConfig(policy_loss="sapo", sapo_tau_pos=tau, loss_agg_mode="token-sum-norm",
                         loss_scale_factor=1.0)
        _, g, _ = run(cfg, [[math.log(r)]], [[0.0]], [[1.0]], [[1]])
        return -g[0][0]  # gradient weight on dlogp for A = 1

    close(weight(1.0, 1.0), 1.0)
    close(weight(1.0, 8.0), 1.0)
    for r in (0.5, 1.5, 3.0):  # analytic weight 4 s (1 - s) r
        s = sigmoid(8.0 * (r - 1))
        close(weight(r, 8.0), 4 * s * (1 - s) * r)
        assert 0 < weight(r, 8.0) < weight(r, 1.0)
    # PPO with eps = 0.2 gives exactly 0 at r = 1.5 (A > 0); SAPO keeps a small, non-zero weight
    assert 0 < weight(1.5, 8.0) < 0.2
    # monotone decay away from 1 on the high side for a sharp gate
    ws = [weight(r, 8.0) for r in (1.2, 1.5, 2.0, 3.0)]
    assert all(a > b for a, b in zip(ws, ws[1:]))


def test_sapo_metrics():
    cfg = LossConfig.for_algorithm("sapo")
    loss, _, m = run(cfg, [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]], [[1, 1]])
    close(loss, (-2 / 1.0 + 2 / 1.05) / 2)  # value at r = 1 is -2A/tau
    close(m["sapo/grad_weight_mean"], 1.0, MATOL)
    close(m["sapo/grad_weight_min"], 1.0, MATOL)


# ---- DPPO -----------------------------------------------------------------------------------
# (q = old prob, p = new prob, A); delta_TV = 0.15, C = 20
TV_ROWS = [
    [(0.5, 0.64, 1.0), (0.5, 0.66, 1.0), (0.5, 0.2, 1.0), (0.001, 0.1, 1.0), (0.9, 0.99, 1.0)],
    [(0.5, 0.36, -1.0), (0.5, 0.34, -1.0), (0.3, 0.9, -0.5), (0.5, 0.9, 0.0), (0.5, 0.1, 0.0)],
    [(0.2, 0.9, 1.0), (0.5, 0.5, 2.0), (0.6, 0.3, -2.0), (0.4, 0.45, 1.0), (0.5, 0.5, 0.0)],
]
DP_M = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1, 0, 1]]   # row 2: holes at 1 and 3
# delta_KL = 0.05; q = 0.5: KL(0.65) = 0.0472 (in), KL(0.66) = 0.0540 (out); q = 0.9 -> 0.99 has
# KL = 0.1445 (out) although r = 1.1 and TV = 0.09 are small
KL_ROWS = [
    [(0.5, 0.65, 1.0), (0.5, 0.66, 1.0), (0.5, 0.2, 1.0), (0.99, 0.999, 1.0), (0.9, 0.99, 1.0)],
    [(0.5, 0.35, -1.0), (0.5, 0.34, -1.0), (0.3, 0.9, -0.5), (0.5, 0.9, 0.0), (0.5, 0.1, 0.0)],
    [(0.001, 0.1, 1.0), (0.5, 0.5, 2.0), (0.6, 0.3, -2.0), (0.4, 0.45, 1.0), (0.5, 0.5, 0.0)],
]


def dppo_reference(q, p, a, kind, delta, cap=20.0, sq=0.0):
    """(value, dvalue/dlogp, masked) of one token from the paper's binary divergences."""
    if kind == "tv":
        div = abs(p - q)
    else:
        div = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    moving_away = (p > q) if a > 0 else (p < q)
    masked = moving_away and div > delta
    r = p / q
    lr = math.log(r)
    w = min(r, cap)
    value = 0.0 if masked else -a * w
    grad = 0.0 if masked else -a * w
    return value + sq * lr * lr, grad + 2 * sq * lr, masked


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_vector_every_aggregation(kind, mode):
    rows, delta = (TV_ROWS, 0.15) if kind == "tv" else (KL_ROWS, 0.05)
    cfg = LossConfig.for_algorithm(f"dppo_{kind}", loss_agg_mode=mode, loss_scale_factor=C_NORM)
    old = [[math.log(q) for q, _, _ in row] for row in rows]
    logp = [[math.log(p) for _, p, _ in row] for row in rows]
    adv = [[a for _, _, a in row] for row in rows]
    loss, grad, m = run(cfg, logp, old, adv, DP_M)
    ref = [[dppo_reference(q, p, a, kind, delta) for q, p, a in row] for row in rows]
    want_loss, want_grad = token_level_expected([[v for v, _, _ in r] for r in ref],
                                                [[g for _, g, _ in r] for r in ref], DP_M, mode)
    close(loss, want_loss)
    close(grad, want_grad)
    n_valid = sum(map(sum, DP_M))
    masked = [ref[i][t][2] for i in range(3) for t in range(5) if DP_M[i][t]]
    close(m["policy/clip_frac"], sum(masked) / n_valid, MATOL)
    # the intended boundary cases: just inside kept, just outside masked
    assert [r[2] for r in ref[0][:2]] == [False, True]
    assert [r[2] for r in ref[1][:2]] == [False, True]
    assert ref[0][2][2] is False and ref[1][2][2] is False  # moving the "right" way: kept
    if kind == "tv":
        assert ref[0][4][2] is False  # q = 0.9 -> 0.99: small TV, kept
        close(m["dppo/truncated_frac"], 1 / n_valid, MATOL)  # q = 1e-3 -> 0.1: r = 100 > C
    else:
        assert ref[0][4][2] is True   # q = 0.9 -> 0.99: binary KL 0.14 > 0.05, masked
        assert ref[0][3][2] is False  # q = 0.99 -> 0.999 near p = 1: KL 0.014, kept


def test_dppo_sq_log_ratio_term_and_cap():
    """prime-rl's kl_tau (log r)^2 on every valid token (masked or not), and the TIS cap."""
    rows = TV_ROWS
    cfg = LossConfig.for_algorithm("dppo_tv", dppo_sq_log_ratio_coef=1e-3, dppo_ratio_cap=50.0)
    old = [[math.log(q) for q, _, _ in row] for row in rows]
    logp = [[math.log(p) for _, p, _ in row] for row in rows]
    adv = [[a for _, _, a in row] for row in rows]
    loss, grad, _ = run(cfg, logp, old, adv, DP_M)
    ref = [[dppo_reference(q, p, a, "tv", 0.15, cap=50.0, sq=1e-3) for q, p, a in row]
           for row in rows]
    want_loss, want_grad = token_level_expected([[v for v, _, _ in r] for r in ref],
                                                [[g for _, g, _ in r] for r in ref], DP_M,
                                                "token-mean")
    close(loss, want_loss)
    close(grad, want_grad)
    assert grad[0][1] != 0.0  # masked token still feels the (log r)^2 term


def test_dppo_masks_where_ppo_would_not_and_vice_versa():
    """The paper's motivating cases: rare-token jump kept (PPO clips it), likely-token drop masked
    (PPO's 0.8 ratio is inside its band)."""
    cfg = LossConfig.for_algorithm("dppo_tv")
    _, g, m = run(cfg, [[math.log(1e-3), math.log(0.79)]], [[math.log(1e-5), math.log(0.99)]],
                  [[1.0, -1.0]], [[1, 1]])
    close(g[0], [-20.0 / 2, 0.0])   # r = 100 kept (capped at C = 20); drop of 0.2 masked
    close(m["policy/clip_frac"], 0.5, MATOL)


def test_new_fields_validated_at_load_time():
    from megatron_rl.loss import LossConfigError
    for field, value, allowed in [("gmpo_clip_low", 0.0, "(0, inf)"),
                                  ("sapo_tau_neg", -1.0, "(0, inf)"),
                                  ("dppo_tv_delta_high", 1.5, "[0, 1]"),
                                  ("dppo_kl_delta_low", 0.0, "(0, inf)"),
                                  ("dppo_ratio_cap", 1.0, "(1, inf]"),
                                  ("dppo_sq_log_ratio_coef", -1e-3, "[0, inf)")]:
        with pytest.raises(LossConfigError) as e:
            LossConfig(**{field: value}).validate()
        assert field in str(e.value) and allowed in str(e.value)


# ---- rollout_correction composes with every new loss ----------------------------------------
@pytest.mark.parametrize("name", ["gmpo", "sapo", "dppo_tv", "dppo_kl"])
def test_rollout_correction_scales_each_token(name):
    """TIS with rho = 1.5 < C on every token scales loss and gradient by exactly 1.5; MIS with
    rho = 3 > C drops everything."""
    old = [[-1.0, -0.8, -1.3, -0.5], [-0.2, -1.0, -0.6, -2.0]]
    logp = [[-0.9, -0.95, -1.2, 0.0], [-0.3, -1.1, -0.5, -1.8]]
    adv = [[1.0] * 4, [-0.5] * 4]
    mask = [[1, 0, 1, 1], [1, 1, 1, 0]]
    base, gb, _ = run(LossConfig.for_algorithm(name), logp, old, adv, mask)
    roll = [[o - math.log(1.5) for o in row] for row in old]
    tis, gt, m = run(LossConfig.for_algorithm(name, rollout_correction="tis"), logp, old, adv,
                     mask, rollout=roll)
    close(tis, 1.5 * base)
    close(gt, [[1.5 * x for x in row] for row in gb])
    close(m["rollout_corr/weight_mean"], 1.5, MATOL)
    roll3 = [[o - math.log(3.0) for o in row] for row in old]
    mis, gm, _ = run(LossConfig.for_algorithm(name, rollout_correction="mis"), logp, old, adv,
                     mask, rollout=roll3)
    close(mis, 0.0)
    close(gm, [[0.0] * 4] * 2)
    assert abs(base) > 1e-3


def test_gmpo_rollout_correction_uses_mean_token_weight():
    old, logp = [[-1.0, -1.0, -1.0]], [[-0.9, -1.1, -1.0]]
    w = [1.0, 2.0, 0.5]  # TIS weights (C = 2 caps nothing at 2.0)
    roll = [[o - math.log(x) for o, x in zip(old[0], w, strict=True)]]
    base, _, _ = run(LossConfig.for_algorithm("gmpo"), logp, old, [[1.0] * 3], [[1, 1, 1]])
    got, _, _ = run(LossConfig.for_algorithm("gmpo", rollout_correction="tis"), logp, old,
                    [[1.0] * 3], [[1, 1, 1]], rollout=roll)
    close(got, base * sum(w) / 3)


# ---- fused linear + log-prob head ------------------------------------------------------------
@pytest.mark.parametrize("name", ["gmpo", "sapo", "dppo_tv", "dppo_kl"])
def test_fused_head_gives_the_unfused_gradients(name):
    """logp from the fused head (row-chunked, no [N, V] logits kept; fp32) vs log_softmax(h W^T):
    the new losses back-propagate the same gradients into the hidden states and the head weight."""
    from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy

    g = torch.Generator().manual_seed(3)
    b, t, h, v = 3, 5, 8, 11
    hidden = torch.randn(b * t, h, generator=g, dtype=torch.float32)
    weight = torch.randn(v, h, generator=g, dtype=torch.float32)
    labels = torch.randint(0, v, (b * t,), generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.0], dtype=torch.float32)[:, None].expand(b, t)
    with torch.no_grad():
        ref_lp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, labels[:, None])[:, 0]
    old = (ref_lp + 0.3 * torch.randn(b * t, generator=g, dtype=torch.float32)).view(b, t)
    cfg = LossConfig.for_algorithm(name, dppo_tv_delta_low=0.05, dppo_tv_delta_high=0.05,
                                   dppo_kl_delta_low=0.01, dppo_kl_delta_high=0.01,
                                   gmpo_clip_low=0.2, gmpo_clip_high=0.2)
    ctx = Ctx.from_minibatch(mask, group=None)
    grads = []
    for fused in (True, False):
        hd, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            lp, _ = fused_linear_logprob_entropy(hd, w, labels, backend="torch", chunk_size=4,
                                                 compute_entropy=False)
        else:
            lp = torch.log_softmax(hd @ w.t(), -1).gather(-1, labels[:, None])[:, 0]
        out = compute_loss(LossInputs(lp.view(b, t), old, adv, mask), cfg, ctx)
        out.loss.backward()
        grads.append((float(out.loss.detach()), hd.grad, w.grad))
    (lf, hf, wf), (lu, hu, wu) = grads
    close(lf, lu, 1e-6)
    torch.testing.assert_close(hf, hu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wf, wu, atol=1e-5, rtol=1e-5)
    assert hu.abs().max() > 1e-3


# ---- no host syncs; CUDA ----------------------------------------------------------------------
NEW_LOSSES = ["gmpo", "sapo", "dppo_tv", "dppo_kl"]


def _random_inputs(device: str, seed: int = 0) -> tuple[LossInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(4, 7, generator=g) > 0.3
    old = -torch.rand(4, 7, generator=g) * 3
    lp = (old + 0.3 * torch.randn(4, 7, generator=g)).to(device).requires_grad_(True)
    adv = torch.randn(4, 1, generator=g).expand(4, 7).clone()
    adv[0] = 0.0
    roll = old - 0.2 * torch.randn(4, 7, generator=g)
    inp = LossInputs(lp, old.to(device), adv.to(device), mask.to(device),
                     rollout_logp=roll.to(device))
    return inp, lp


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_new_losses_run_without_host_sync(name):
    from megatron_rl.testing.device_spy import CountHostSyncs

    inp, _ = _random_inputs("cpu")
    cfg = LossConfig.for_algorithm(name, rollout_correction="tis", dppo_sq_log_ratio_coef=1e-3)
    ctx = Ctx.from_minibatch(inp.mask, group=None)
    with CountHostSyncs() as syncs:
        out = compute_loss(inp, cfg, ctx)
        out.loss_for_backward.backward()
        acc = MetricAccumulator()
        acc.update(out.stats)
        acc.reduce(ctx)
    assert syncs.n == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", NEW_LOSSES)
def test_new_losses_on_cuda_match_cpu(name):
    cfg = LossConfig.for_algorithm(name, rollout_correction="tis")
    res = []
    for device in ("cpu", "cuda"):
        inp, lp = _random_inputs(device)
        ctx = Ctx.from_minibatch(inp.mask, group=None)
        out = compute_loss(inp, cfg, ctx)
        out.loss.backward()
        assert out.loss.device.type == device
        res.append((out.loss.detach().cpu(), lp.grad.cpu()))
    torch.testing.assert_close(res[1][0], res[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(res[1][1], res[0][1], atol=1e-6, rtol=1e-5)
