"""Off-policy correction (loss/rollout_correction.py): the five weight modes against hand-written
and independent float64 values (weights just inside / outside every bound, masks with holes,
an empty row), their metrics, the three-policy decomposition in the PPO loss (clip against the
proximal policy, weight = proximal / behaviour) for both advantage signs and every aggregation
mode, and the load-time validation of the mode and its thresholds."""

import math

import pytest
import torch

from megatron_rl.config.load import load_config
from megatron_rl.loss import LossConfig, LossConfigError, MetricAccumulator
from megatron_rl.loss.compute import compute_loss
from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.params import AGG_MODES
from megatron_rl.loss.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CorrectionBounds,
    compute_correction,
    correction_stats,
    correction_weights,
    denominator_masks,
)
from megatron_rl.loss.types import LossInputs

X = 1.0009 ** 5  # row 2: geometric mean of [3, 1/3, X, 1, 1] is 1.0009 (inside [0.999, 1.001])
HOLE = 100.0  # the ratio at masked positions: must change nothing
# rho = proximal / behaviour per token (rollout_logp = 0, old_logp = log rho); 0 = masked out
RHO = [[1.998, 2.002, HOLE, 0.4995, 0.5005, 4.995],   # every token bound, inside and outside
       [5.005, 0.3, 1.0, 3.0, HOLE, HOLE],
       [3.0, 1 / 3, X, 1.0, HOLE, 1.0],                 # kept row with a token above C
       [1.0011, 1.0011, 1.0011, HOLE, HOLE, HOLE],      # geometric mean 1.0011: dropped
       [0.9989, HOLE, 0.9989, HOLE, HOLE, HOLE],        # 0.9989: dropped
       [0.9991, 0.9991, 0.9991, 0.9991, HOLE, HOLE],    # 0.9991: kept
       [HOLE] * 6]                                      # empty row
MASK = [[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0] * 6]
B, T = len(RHO), len(RHO[0])

# hand-computed weights (C = 2, icepop [0.5, 5], seq band [0.999, 1.001])
HAND = {
    "tis": [[1.998, 2.0, 0, 0.4995, 0.5005, 2.0], [2.0, 0.3, 1.0, 2.0, 0, 0],
            [2.0, 1 / 3, X, 1.0, 0, 1.0], [1.0011] * 3 + [0] * 3,
            [0.9989, 0, 0.9989, 0, 0, 0], [0.9991] * 4 + [0, 0], [0] * 6],
    "mis": [[1.998, 0, 0, 0, 0.5005, 0], [0, 0, 1.0, 0, 0, 0], [0, 0, X, 1.0, 0, 1.0],
            [1.0011] * 3 + [0] * 3, [0.9989, 0, 0.9989, 0, 0, 0], [0.9991] * 4 + [0, 0],
            [0] * 6],
    "icepop": [[1.998, 2.002, 0, 0, 0.5005, 4.995], [0, 0, 1.0, 3.0, 0, 0],
               [3.0, 0, X, 1.0, 0, 1.0], [1.0011] * 3 + [0] * 3,
               [0.9989, 0, 0.9989, 0, 0, 0], [0.9991] * 4 + [0, 0], [0] * 6],
    "seq_mask_tis": [[0] * 6, [0] * 6, [2.0, 1 / 3, X, 1.0, 0, 1.0], [0] * 6, [0] * 6,
                     [0.9991] * 4 + [0, 0], [0] * 6],
}


def tensors(dtype=torch.float32):
    old = torch.tensor([[math.log(r) for r in row] for row in RHO], dtype=dtype)
    return old, torch.zeros(B, T, dtype=dtype), torch.tensor(MASK, dtype=torch.bool)


def ref_weights(mode: str, rho=RHO, mask=MASK, c=2.0, ice=(0.5, 5.0), seq=(0.999, 1.001)):
    """Independent float64 derivation of the module docstring's formulas (python floats)."""
    out = []
    for row, m in zip(rho, mask):
        logs = [math.log(r) for r, v in zip(row, m) if v]
        geo = math.exp(sum(logs) / len(logs)) if logs else 1.0
        keep_row = seq[0] <= geo <= seq[1]
        w_row = []
        for r, v in zip(row, m):
            if not v:
                w = 0.0
            elif mode == "none":
                w = 1.0
            elif mode == "tis":
                w = min(r, c)
            elif mode == "mis":
                w = r if 1 / c <= r <= c else 0.0
            elif mode == "icepop":
                w = r if ice[0] <= r <= ice[1] else 0.0
            else:
                w = min(r, c) if keep_row else 0.0
            w_row.append(w)
        out.append(w_row)
    return out


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               torch.as_tensor(want, dtype=torch.float64), atol=atol, rtol=1e-6)


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_weights_hand_computed(mode):
    old, roll, mask = tensors()
    w = correction_weights(old, roll, mask, mode, 2.0)
    close(w, ref_weights(mode))
    if mode != "none":
        close(w, HAND[mode])
    assert w.dtype == torch.float32 and not w.requires_grad


def test_bounds_are_the_configured_ones():
    """Other thresholds move the decisions the way the formulas say (independent derivation)."""
    old, roll, mask = tensors(torch.float64)
    b = dict(icepop_low=0.29, icepop_high=3.0, seq_mask_low=0.99, seq_mask_high=1.01)
    for mode in ("tis", "mis", "icepop", "seq_mask_tis"):
        w = correction_weights(old, roll, mask, mode, 2.5, **b)
        close(w, ref_weights(mode, c=2.5, ice=(0.29, 3.0), seq=(0.99, 1.01)))
    # with the wider band rows 3 and 4 are kept; row 1's geometric mean (1.46) is not
    w = correction_weights(old, roll, mask, "seq_mask_tis", 2.0, seq_mask_low=0.99,
                           seq_mask_high=1.01)
    assert bool(w[3, :3].gt(0).all() and w[4, 0].gt(0)) and not bool(w[1].any())


def _reduce(stats):
    acc = MetricAccumulator()
    acc.update(stats)
    return {k: float(v) for k, v in acc.reduce(ReductionContext.from_minibatch(
        torch.tensor(MASK, dtype=torch.bool), group=None)).items()}


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_metrics_hand_computed(mode):
    old, roll, mask = tensors()
    got = _reduce(correction_stats(compute_correction(old, roll, mask, mode), mask, mode))
    valid = [(r, w) for row, wrow, m in zip(RHO, ref_weights(mode), MASK)
             for r, w, v in zip(row, wrow, m) if v]
    n = len(valid)
    assert n == 23
    want = {"rollout_corr/kl_k3": sum(r - 1 - math.log(r) for r, _ in valid) / n,
            "rollout_corr/ratio_mean": sum(r for r, _ in valid) / n,
            "rollout_corr/ratio_max": max(r for r, _ in valid)}
    if mode != "none":
        clipped = {"tis": 5, "mis": 0, "icepop": 0, "seq_mask_tis": 1}[mode]  # rho > C kept
        zeroed = sum(1 for r, w in valid if w == 0.0)
        want.update({"rollout_corr/weight_mean": sum(w for _, w in valid) / n,
                     "rollout_corr/weight_max": max(w for _, w in valid),
                     "rollout_corr/clipped_frac": clipped / n,
                     "rollout_corr/masked_frac": zeroed / n})
        assert zeroed == {"tis": 0, "mis": 8, "icepop": 4, "seq_mask_tis": 14}[mode]
    if mode == "seq_mask_tis":
        want["rollout_corr/seq_masked_frac"] = 4 / 6  # rows 0, 1, 3, 4 of the 6 non-empty
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5), k


# ---- the three-policy decomposition inside the loss ----------------------------------------
R_CUR = [1.0, 1.5, 0.7]  # current / proximal ratios, cycled along each row
ADV = [1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 1.0]  # per row: both signs


def _ppo_ref(mode: str, agg: str, c_norm: float = 8.0):
    """float64 loss and dloss/dlogp: L_t = w_t * max(-A r_t, -A clip(r_t, 0.8, 1.2)) with
    r_t = pi_theta / pi_prox (the policy's clip) and w_t = f(pi_prox / mu), then ``agg``."""
    w = ref_weights(mode)
    vals, grads = [], []
    for i in range(B):
        v_row, g_row = [], []
        for t in range(T):
            r, a = R_CUR[t % 3], ADV[i]
            unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.2)
            v_row.append(w[i][t] * max(unclipped, clipped))
            g_row.append(w[i][t] * (-a * r if unclipped >= clipped else 0.0))
        vals.append(v_row)
        grads.append(g_row)
    n_tok = sum(map(sum, MASK))
    rows = [i for i in range(B) if any(MASK[i])]
    coef = [[0.0] * T for _ in range(B)]
    for i in rows:
        n_i = sum(MASK[i])
        for t in range(T):
            if MASK[i][t]:
                coef[i][t] = {"token-mean": 1 / n_tok,
                              "seq-mean-token-mean": 1 / n_i / len(rows),
                              "seq-mean-token-sum": 1 / len(rows),
                              "seq-mean-token-sum-norm": 1 / c_norm / len(rows),
                              "token-sum-norm": 1 / c_norm}[agg]
    loss = sum(coef[i][t] * vals[i][t] for i in range(B) for t in range(T))
    return loss, [[coef[i][t] * grads[i][t] for t in range(T)] for i in range(B)]


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_loss_clips_against_proximal_and_weights_by_behaviour(agg):
    """Every mode x every aggregation: loss and gradient equal the float64 derivation. A token
    with r = 1.5 and A > 0 is clipped (no gradient) whatever its weight; a token with r = 1 but
    rho = 1.998 (far from the behaviour policy) is not clipped: the clip reads pi_theta / pi_prox,
    never pi_theta / mu."""
    old, roll, mask = tensors(torch.float64)
    logp0 = old + torch.log(torch.tensor(R_CUR * 2, dtype=torch.float64))[None, :]
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(B, T)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    for mode in ROLLOUT_CORRECTIONS:
        cfg = LossConfig.for_algorithm("ppo", loss_agg_mode=agg, loss_scale_factor=8.0,
                                       rollout_correction=mode)
        logp = logp0.clone().requires_grad_(True)
        out = compute_loss(LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask,
                                      rollout_logp=roll), cfg, ctx)
        out.loss.backward()
        want_loss, want_grad = _ppo_ref(mode, agg)
        assert float(out.pg_loss) == pytest.approx(want_loss, rel=1e-6, abs=1e-9), mode
        close(logp.grad, want_grad, atol=1e-7)
        if mode == "tis":  # row 1, t = 1: rho = 0.3, r = 1.5, A = -1 -> unclipped branch
            assert float(logp.grad[1, 1]) != 0.0 and float(logp.grad[0, 1]) == 0.0
            assert float(logp.grad[0, 0]) != 0.0  # r = 1, rho = 1.998: inside the clip


def test_on_policy_proximal_is_the_current_policy_detached():
    """One update per rollout (ppo_epochs = 1, one mini-batch): the proximal log-probs equal the
    current ones, so r = 1, nothing is clipped, and the gradient is the weighted policy gradient
    -w * A / N with w = f(pi_theta / mu) (detached): float64 derivation for both signs of A."""
    old, roll, mask = tensors(torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(B, T)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    n_tok = sum(map(sum, MASK))
    for mode in ("tis", "seq_mask_tis"):
        logp = old.clone().requires_grad_(True)
        cfg = LossConfig.for_algorithm("ppo", rollout_correction=mode)
        out = compute_loss(LossInputs(logp=logp, old_logp=logp.detach(), advantages=adv,
                                      mask=mask, rollout_logp=roll), cfg, ctx)
        out.loss.backward()
        w = ref_weights(mode)
        close(logp.grad, [[-w[i][t] * ADV[i] / n_tok for t in range(T)] for i in range(B)],
              atol=1e-9)
        assert float(out.pg_loss) == pytest.approx(
            sum(-w[i][t] * ADV[i] for i in range(B) for t in range(T)) / n_tok, rel=1e-6)


def test_correction_without_rollout_logp_is_an_error():
    cfg = LossConfig.for_algorithm("ppo", rollout_correction="icepop")
    old, _, mask = tensors()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    with pytest.raises(ValueError, match="rollout_correction='icepop' needs"):
        compute_loss(LossInputs(logp=old, old_logp=old, advantages=torch.ones(B, T), mask=mask),
                     cfg, ctx)


# ---- configuration -------------------------------------------------------------------------
def test_config_defaults_and_passthrough():
    cfg = load_config(None, ["loss.rollout_correction=seq_mask_tis",
                             "loss.seq_mask_low=0.99", "loss.icepop_high=4"]).loss.build()
    assert (cfg.rollout_correction, cfg.rollout_correction_threshold, cfg.seq_mask_low,
            cfg.seq_mask_high, cfg.icepop_low, cfg.icepop_high) == (
        "seq_mask_tis", 2.0, 0.99, 1.001, 0.5, 4.0)
    assert CorrectionBounds() == CorrectionBounds(2.0, 0.5, 5.0, 0.999, 1.001)


@pytest.mark.parametrize("overrides,field", [
    (["loss.rollout_correction=foo"], "rollout_correction"),
    (["loss.rollout_correction=tis", "loss.rollout_correction_threshold=0.5"],
     "rollout_correction_threshold"),
    (["loss.icepop_low=1.5"], "icepop_low"),
    (["loss.icepop_high=0.9"], "icepop_high"),
    (["loss.seq_mask_low=0"], "seq_mask_low"),
    (["loss.seq_mask_high=0.5"], "seq_mask_high"),
    (["loss.icepop_low=1", "loss.icepop_high=1"], "icepop_low"),
    (["loss.rollout_correction_denominator=valid"], "rollout_correction_denominator"),
])
def test_config_rejects_bad_values_at_load_time(overrides, field):
    with pytest.raises(ValueError, match=field) as e:
        load_config(None, overrides)
    if field == "rollout_correction":
        assert "icepop" in str(e.value) and "seq_mask_tis" in str(e.value)
    if field == "rollout_correction_denominator":
        assert "'all', 'kept'" in str(e.value)


def test_loss_config_rejects_bad_band():
    with pytest.raises(LossConfigError, match=r"seq_mask_low=1\.2.*\(0, 1\]"):
        LossConfig(seq_mask_low=1.2).validate()
    with pytest.raises(LossConfigError, match="icepop_low .* must be < icepop_high"):
        LossConfig(icepop_low=1.0, icepop_high=1.0).validate()
    LossConfig(icepop_low=0.0, icepop_high=math.inf).validate()  # AReaL-style one-sided cap


def test_device_discipline_of_every_mode():
    """Under the device spy (tests/test_device_discipline.py): no tensor factory without a device,
    no host sync inside ``compute_loss``, every result on the inputs' device, for every mode."""
    from megatron_rl.testing.device_spy import DeviceSpy

    old, roll, mask = tensors()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    spy = DeviceSpy(device=old.device, micro_batch_functions=("compute_loss",))
    with spy:
        for mode in ROLLOUT_CORRECTIONS:
            cfg = LossConfig.for_algorithm("ppo", rollout_correction=mode)
            compute_loss(LossInputs(logp=old.clone().requires_grad_(True), old_logp=old,
                                    advantages=torch.ones(B, T), mask=mask, rollout_logp=roll),
                         cfg, ctx)
    assert spy.calls > 50 and spy.report() == "", spy.report()


# ---- denominator under rejection (issue 38 item 3) -----------------------------------------
# mis, C = 2; rollout_logp = 0, old_logp = logp = log rho (ratio 1: PPO's token loss is -A).
# row 0: rho [1, 4, 1] (token 1 rejected), A = 1; row 1: rho [1, 1, pad], A = 2;
# row 2: rho [4, pad, pad] (its only token rejected), A = 3.
DEN_RHO = [[1.0, 4.0, 1.0], [1.0, 1.0, 1.0], [4.0, 1.0, 1.0]]
DEN_MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
DEN_ADV = [[1.0] * 3, [2.0] * 3, [3.0] * 3]
# token losses of the kept tokens: -1, -1 (row 0), -2, -2 (row 1); nothing else contributes.
DEN_HAND = {  # (denominator, loss_agg_mode) -> loss
    ("all", "token-mean"): -6 / 6,                        # 6 valid tokens
    ("kept", "token-mean"): -6 / 4,                       # 4 kept tokens
    ("all", "seq-mean-token-mean"): (-2 / 3 - 4 / 2 + 0) / 3,  # 3 rows, row 0 over 3 tokens
    ("kept", "seq-mean-token-mean"): (-2 / 2 - 4 / 2) / 2,     # 2 rows keep a token
}


def _denominator_loss(denominator: str, agg: str, split: bool) -> float:
    """The loss of the DEN_* mini-batch (one micro-batch, or rows {0} and {1, 2})."""
    cfg = LossConfig.for_algorithm("ppo", rollout_correction="mis", loss_agg_mode=agg,
                                   rollout_correction_denominator=denominator)
    logp = torch.tensor(DEN_RHO, dtype=torch.float64).log()
    mask, adv = torch.tensor(DEN_MASK, dtype=torch.bool), torch.tensor(DEN_ADV)
    parts = [slice(0, 1), slice(1, 3)] if split else [slice(0, 3)]
    mbs = [{"old_logp": logp[p], "rollout_logp": torch.zeros_like(logp[p]), "mask": mask[p],
            "advantages": adv[p]} for p in parts]
    ctx = ReductionContext.from_minibatch([mb["mask"] for mb in mbs], group=None,
                                          extra_masks=denominator_masks(mbs, cfg))
    return sum(float(compute_loss(LossInputs(logp=mb["old_logp"], **mb), cfg, ctx).loss)
               for mb in mbs)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("split", [False, True])
def test_partial_denominator_all_keeps_rejected_tokens(agg, split):
    """Default ``all``: a token the correction rejects stays in the denominators (NeMo-RL)."""
    assert LossConfig().rollout_correction_denominator == "all"
    assert _denominator_loss("all", agg, split) == pytest.approx(DEN_HAND[("all", agg)])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("split", [False, True])
def test_partial_denominator_kept_drops_rejected_tokens(agg, split):
    """``kept``: rejected tokens (and rows with none kept) leave the denominators (verl), also
    when the rows are split over micro-batches (global counts)."""
    assert _denominator_loss("kept", agg, split) == pytest.approx(DEN_HAND[("kept", agg)])


def test_partial_denominator_kept_needs_its_counts():
    cfg = LossConfig.for_algorithm("ppo", rollout_correction="mis",
                                   rollout_correction_denominator="kept")
    old, roll, mask = tensors()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    with pytest.raises(ValueError, match="denominator_masks"):
        compute_loss(LossInputs(logp=old, old_logp=old, advantages=torch.ones(B, T), mask=mask,
                                rollout_logp=roll), cfg, ctx)
    load = load_config(None, ["loss.rollout_correction_denominator=kept"]).loss.build()
    assert load.rollout_correction_denominator == "kept"
