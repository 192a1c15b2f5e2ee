"""Rollout-correction weights (TIS / MIS) against hand-computed values, and their effect on the
loss through ``compute_loss``."""

import math

import pytest
import torch

from megatron_rl.config.load import load_config
from megatron_rl.loss import LossConfig
from megatron_rl.loss.compute import compute_loss
from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.rollout_correction import correction_weights, mismatch_stats
from megatron_rl.loss.types import LossInputs

# rho = exp(old - rollout) = [3, 1.5, 0.25, 1] on the valid tokens; the last token is padding
OLD = torch.log(torch.tensor([[3.0, 1.5, 0.25, 1.0, 7.0]]))
ROLL = torch.zeros(1, 5)
MASK = torch.tensor([[True, True, True, True, False]])


def test_tis_weights_hand_computed():
    w = correction_weights(OLD, ROLL, MASK, "tis", 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.5, 0.25, 1.0, 0.0]]), atol=1e-6)


def test_mis_weights_hand_computed():
    w = correction_weights(OLD, ROLL, MASK, "mis", 2.0)
    # 3 > C and 0.25 < 1/C are masked out; 1.5 and 1 stay
    assert torch.allclose(w, torch.tensor([[0.0, 1.5, 0.0, 1.0, 0.0]]), atol=1e-6)
    w4 = correction_weights(OLD, ROLL, MASK, "mis", 4.0)
    assert torch.allclose(w4, torch.tensor([[3.0, 1.5, 0.25, 1.0, 0.0]]), atol=1e-6)


def test_mismatch_stats_hand_computed():
    w = correction_weights(OLD, ROLL, MASK, "tis", 2.0)
    st = mismatch_stats(OLD, ROLL, MASK, w)
    assert "rollout_corr/logp_abs_diff" not in st  # the trainer's rollout/logp_mismatch_*
    k3 = [r - 1 - math.log(r) for r in (3, 1.5, 0.25, 1)]
    k = st["rollout_corr/kl_k3"]
    assert float((k.value * k.weight).sum() / k.weight.sum()) == pytest.approx(sum(k3) / 4,
                                                                              rel=1e-5)


def _loss(mode: str) -> float:
    cfg = LossConfig.for_algorithm("ppo", rollout_correction=mode, loss_agg_mode="token-sum-norm",
                                   loss_scale_factor=1.0)
    logp = OLD.clone()  # on-policy w.r.t. the actor: ratio 1, per-token loss = -A
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    ctx = ReductionContext.from_minibatch([MASK])
    out = compute_loss(LossInputs(logp=logp, old_logp=OLD, advantages=adv, mask=MASK,
                                  rollout_logp=ROLL), cfg, ctx)
    return float(out.pg_loss)


def test_loss_is_weighted_by_the_correction():
    assert _loss("none") == pytest.approx(-(1 + 2 + 3 + 4), rel=1e-5)
    assert _loss("tis") == pytest.approx(-(2 * 1 + 1.5 * 2 + 0.25 * 3 + 1 * 4), rel=1e-5)
    assert _loss("mis") == pytest.approx(-(1.5 * 2 + 1 * 4), rel=1e-5)


def test_config_rejects_unknown_mode_and_bad_threshold():
    with pytest.raises(ValueError, match="rollout_correction"):
        load_config(None, ["loss.rollout_correction=foo"])
    with pytest.raises(ValueError, match="rollout_correction_threshold"):
        load_config(None, ["loss.rollout_correction=tis", "loss.rollout_correction_threshold=0.5"])
    cfg = load_config(None, ["loss.rollout_correction=mis"]).loss.build()
    assert cfg.rollout_correction == "mis" and cfg.rollout_correction_threshold == 2.0
