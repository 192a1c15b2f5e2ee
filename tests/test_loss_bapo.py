"""BAPO (megatron_rl/loss/bapo.py): hand-computed bounds and loss, the search against a
transcription of the reference's loop, micro-batch invariance of the bounds, no host sync,
config validation.
Layout invariance over DP=2 and micro-batch splits is in tests/test_loss_layout.py (case "bapo")."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.loss import LossConfig, LossConfigError, LossInputs, ReductionContext, compute_loss
from megatron_rl.loss.bapo import bapo_bounds, bound_steps, candidate_grid

# two rows of three tokens: A = +1 (ratios e^0.5, e^-0.5, e^0.1), A = -2 (e^-1, e^0.3, e^0)
LOGP = torch.tensor([[0.5, -0.5, 0.1], [-1.0, 0.3, 0.0]])
OLD = torch.zeros(2, 3)
ADV = torch.tensor([[1.0], [-2.0]]).expand(2, 3).contiguous()
MASK = torch.ones(2, 3, dtype=torch.bool)


def _ctx(mask=MASK):
    return ReductionContext.from_minibatch(mask, group=None)


def test_bapo_bound_steps_follow_the_reference_loop():
    assert bound_steps(0.6, 0.8, 0.05) == pytest.approx([0.6, 0.65, 0.7, 0.75, 0.8], abs=1e-12)
    assert bound_steps(1.2, 1.3, 0.08) == pytest.approx([1.2, 1.28, 1.3])  # capped at the max
    assert bound_steps(0.7, 0.9, 0.0) == [0.7]  # step 0: fixed


def test_bapo_vector_hand_computed():
    """target 0.5: pos(h) = min(e^.5, h) + e^-.5 + e^.1, neg(l) = 2 (l + e^.3 + 1) for l >= e^-1.
    Raising c_low only lowers pos/neg (0.4935 at (0.6, 1.2), 0.4622 at (0.8, 1.2)); the upper
    bound then rises to 1.45, the first value with pos/neg >= 0.5."""
    cfg = LossConfig(policy_loss="bapo", bapo_target=0.5).validate()
    e = math.exp
    pos = lambda h: min(e(0.5), h) + e(-0.5) + e(0.1)  # noqa: E731
    neg = lambda lo: 2 * (max(e(-1), lo) + e(0.3) + 1)  # noqa: E731
    assert pos(1.2) / neg(0.6) < 0.5 and pos(1.4) / neg(0.8) < 0.5 <= pos(1.45) / neg(0.8)
    got = bapo_bounds(_ctx(), cfg, LOGP, OLD, ADV, MASK)
    torch.testing.assert_close(got.bounds, torch.tensor([0.8, 1.45]))
    assert float(got.stats["bapo/search_steps"]) == 4 + 5  # 4 lower steps, 5 upper steps
    torch.testing.assert_close(got.stats["bapo/pos_frac"],
                               torch.tensor(pos(1.45) / (pos(1.45) + neg(0.8))))
    # the loss: PPO-clip in [0.8, 1.45] + dual clip 3, token-mean over 6 tokens
    x = LOGP.clone().requires_grad_(True)
    out = compute_loss(LossInputs(x, OLD, ADV, MASK, bapo_bounds=got.bounds), cfg, _ctx())
    out.loss.backward()
    # A=+1: e^.5 clipped at 1.45 (no gradient); A=-2: e^-1 clipped at 0.8 (loss 1.6, no gradient)
    want = (-1.45 - e(-0.5) - e(0.1) + 1.6 + 2 * e(0.3) + 2.0) / 6
    assert float(out.loss) == pytest.approx(want, rel=1e-6)
    grad = torch.tensor([[0.0, -e(-0.5), -e(0.1)], [0.0, 2 * e(0.3), 2.0]]) / 6
    torch.testing.assert_close(x.grad, grad)


def test_bapo_stops_at_start_when_balanced_and_ends_at_max_when_never():
    cfg = LossConfig(policy_loss="bapo", bapo_target=0.1).validate()
    got = bapo_bounds(_ctx(), cfg, LOGP, OLD, ADV, MASK)
    torch.testing.assert_close(got.bounds, torch.tensor([0.6, 1.2]))
    cfg = LossConfig(policy_loss="bapo", bapo_target=5.0).validate()
    got = bapo_bounds(_ctx(), cfg, LOGP, OLD, ADV, MASK)
    torch.testing.assert_close(got.bounds, torch.tensor([0.8, 2.0]))
    only_pos = ADV.abs()  # no negative contribution: pos/neg = inf meets any target
    got = bapo_bounds(_ctx(), cfg, LOGP, OLD, only_pos, MASK)
    torch.testing.assert_close(got.bounds, torch.tensor([0.6, 1.2]))


def _reference_search(ratio, adv, mask, cfg) -> tuple[float, float]:
    """A transcription of the reference's bound search (WooooDyy/BAPO recipe/bapo/policy_loss.py:
    ``.item()`` loops over explicit ratio bounds), for comparison only."""
    def pos_neg(lo, hi):
        eff = torch.where(adv >= 0, torch.clamp(ratio, max=hi), torch.clamp(ratio, min=lo))
        contrib = eff * adv * mask
        p, n = contrib.clamp(min=0).sum(), (-contrib.clamp(max=0)).sum()
        return float("inf") if n <= 0 else (p / (n + cfg.bapo_eps)).item()

    lo, hi = cfg.bapo_low_start, cfg.bapo_high_start
    rho = pos_neg(lo, hi)
    while rho < cfg.bapo_target and lo < cfg.bapo_low_max and cfg.bapo_low_step > 0:
        lo = min(lo + cfg.bapo_low_step, cfg.bapo_low_max)
        rho = pos_neg(lo, hi)
    while rho < cfg.bapo_target and hi < cfg.bapo_high_max and cfg.bapo_high_step > 0:
        hi = min(hi + cfg.bapo_high_step, cfg.bapo_high_max)
        rho = pos_neg(lo, hi)
    return lo, hi


@pytest.mark.parametrize("seed", range(6))
def test_bapo_search_matches_reference_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    logp = -torch.rand(b, t, generator=g) * 2
    old = logp + torch.randn(b, t, generator=g) * 0.4
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)
    ratio = torch.exp(logp.double() - old.double())
    for target in (0.3, 0.8, 1.0, 1.5, 3.0):
        cfg = LossConfig(policy_loss="bapo", bapo_target=target).validate()
        want = _reference_search(ratio, adv.double(), mask.double(), cfg)
        got = bapo_bounds(_ctx(mask), cfg, logp, old, adv, mask).bounds
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))


def test_bapo_bounds_are_the_same_for_any_micro_batch_split():
    """The search sums over the whole mini-batch; a per-micro-batch search (the reference's
    scope) picks different bounds on the same data."""
    g = torch.Generator().manual_seed(3)
    b, t = 8, 5
    logp = -torch.rand(b, t, generator=g)
    old = logp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.cat([torch.full((4, t), -1.0), torch.full((4, t), 1.0)])  # signs split by rows
    mask = torch.ones(b, t, dtype=torch.bool)
    cfg = LossConfig(policy_loss="bapo", bapo_target=0.8).validate()
    whole = bapo_bounds(_ctx(mask), cfg, logp, old, adv, mask).bounds
    parts = [slice(0, 3), slice(3, 6), slice(6, 8)]
    ctx = ReductionContext.from_minibatch([mask[s] for s in parts], group=None)
    split = bapo_bounds(ctx, cfg, [logp[s] for s in parts], [old[s] for s in parts],
                        [adv[s] for s in parts], [mask[s] for s in parts]).bounds
    assert torch.equal(whole, split)
    torch.testing.assert_close(whole, torch.tensor([0.6, 1.2]))  # balanced enough at the start
    first = bapo_bounds(_ctx(mask[:4]), cfg, logp[:4], old[:4], adv[:4], mask[:4]).bounds
    # negative control: a micro-batch of negative rows alone pushes both bounds to their maxima
    torch.testing.assert_close(first, torch.tensor([0.8, 2.0]))


def test_bapo_runs_without_host_sync():
    from megatron_rl.testing.device_spy import CountHostSyncs

    cfg = LossConfig(policy_loss="bapo", bapo_target=0.5).validate()
    ctx = _ctx()
    with CountHostSyncs() as syncs:
        got = bapo_bounds(ctx, cfg, LOGP, OLD, ADV, MASK)
        compute_loss(LossInputs(LOGP.clone(), OLD, ADV, MASK, bapo_bounds=got.bounds), cfg, ctx)
    assert syncs.n == 0


def test_bapo_config_validation_and_missing_bounds():
    for bad in (dict(bapo_low_start=0.9, bapo_low_max=0.8), dict(bapo_low_max=1.2),
                dict(bapo_high_start=0.9), dict(bapo_high_max=1.1), dict(bapo_low_step=-0.1),
                dict(bapo_target=-1.0), dict(bapo_eps=0.0)):
        with pytest.raises(LossConfigError, match="bapo_"):
            LossConfig(policy_loss="bapo", **bad).validate()
    cfg = LossConfig.for_algorithm("bapo")
    assert candidate_grid(cfg)[0][-1] == 0.8 and candidate_grid(cfg)[1][-1] == 2.0
    with pytest.raises(ValueError, match="bapo_bounds"):
        compute_loss(LossInputs(LOGP, OLD, ADV, MASK), cfg, _ctx())


@pytest.mark.gpu
def test_bapo_on_cuda_matches_cpu_without_host_sync():
    from megatron_rl.testing.device_spy import CountHostSyncs

    cfg = LossConfig(policy_loss="bapo", bapo_target=0.5).validate()
    res = []
    for device in ("cpu", "cuda"):
        t = [x.to(device) for x in (LOGP, OLD, ADV, MASK)]
        ctx = _ctx(t[3])
        x = t[0].clone().requires_grad_(True)
        with CountHostSyncs() as syncs:
            got = bapo_bounds(ctx, cfg, t[0], t[1], t[2], t[3])
            out = compute_loss(LossInputs(x, t[1], t[2], t[3], bapo_bounds=got.bounds), cfg, ctx)
            out.loss.backward()
        assert syncs.n == 0 and got.bounds.device.type == device
        res.append((got.bounds.cpu(), out.loss.detach().cpu(), x.grad.cpu()))
    for a, b in zip(*res):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
