"""Advantage estimators: ALGORITHMS.md §3 vectors A1-A4 plus GAE and edge cases."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.advantages import (
    advantage_metrics,
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0)


ONE_GROUP = torch.zeros(4, dtype=torch.long)


def test_A1_grpo_unbiased_std():
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1]), ONE_GROUP)
    close(adv, [0.866024, -0.866024, -0.866024, 0.866024])
    assert abs(float(adv[0]) - 0.999998) > 0.1  # not the biased-std convention


def test_A1_dr_grpo_and_rloo():
    r = torch.tensor([1.0, 0, 0, 1])
    close(dr_grpo_advantages(r, ONE_GROUP), [0.5, -0.5, -0.5, 0.5])
    close(rloo_advantages(r, ONE_GROUP), [0.666667, -0.666667, -0.666667, 0.666667])


def test_A2_grpo():
    close(grpo_advantages(torch.tensor([1.0, -1, -1, -1]), ONE_GROUP),
          [1.4999985, -0.4999995, -0.4999995, -0.4999995])


def test_A3_constant_group_and_singleton():
    close(grpo_advantages(torch.ones(4), ONE_GROUP), [0, 0, 0, 0])
    close(grpo_advantages(torch.tensor([0.7]), torch.tensor([3])), [0.7 / (1 + 1e-6)])
    close(rloo_advantages(torch.tensor([0.7]), torch.tensor([3])), [0.7])
    close(dr_grpo_advantages(torch.tensor([0.7]), torch.tensor([3])), [0.7])


def test_groups_are_independent_and_ids_arbitrary():
    r = torch.tensor([1.0, 0, 5.0, 1, 0, 5.0, 7.0])
    gid = torch.tensor([10, 10, 42, 10, 10, 42, 3])
    adv = grpo_advantages(r, gid)
    close(adv[[0, 1, 3, 4]], grpo_advantages(torch.tensor([1.0, 0, 1, 0]), ONE_GROUP))
    close(adv[[2, 5]], [0, 0])
    close(adv[6], 7.0 / (1 + 1e-6))


def test_A4_reinforce_pp():
    rewards = torch.tensor([[0.0, 0, 1], [0, -1, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    close(discounted_returns(rewards, mask), [[1, 1, 1], [-1, -1, 0]])
    close(reinforce_pp_advantages(rewards, mask),
          [[0.730297, 0.730297, 0.730297], [-1.095445, -1.095445, 0]])


def test_reinforce_pp_baseline():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    adv = reinforce_pp_baseline_advantages(scores, gid, mask)
    centred = broadcast_to_tokens(torch.tensor([0.5, -0.5, 1.0, -1.0]), mask)
    vals = centred[mask].double()
    expected = (centred.double() - vals.mean()) / (vals.var(unbiased=True) + 1e-8).sqrt()
    close(adv, expected * mask)


def test_discounted_returns_gamma():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    close(discounted_returns(r, torch.ones(1, 3, dtype=bool), gamma=0.5),
          [[1 + 0.5, 1.0, 2.0]])


def naive_gae(r, v, gamma, lam):
    T = len(r)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        nv = v[t + 1] if t + 1 < T else 0.0
        delta = r[t] + gamma * nv - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    r = [0.0, 0.5, -1.0, 2.0]
    v = [0.3, -0.2, 0.1, 0.4]
    adv, ret = gae_advantages(torch.tensor([r + [9.0]]), torch.tensor([v + [9.0]]),
                              torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool), gamma, lam,
                              whiten=False)
    expected = naive_gae(r, v, gamma, lam)
    close(adv[0, :4], expected)
    close(adv[0, 4], 0.0)
    close(ret[0, :4], [a + b for a, b in zip(expected, v, strict=True)])


def test_gae_whitened():
    adv, _ = gae_advantages(torch.randn(3, 5), torch.randn(3, 5), torch.ones(3, 5, dtype=bool))
    close(adv.mean(), 0.0, atol=1e-5)
    close(adv.std(), 1.0, atol=1e-4)


def test_advantage_metrics():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1])
    adv = broadcast_to_tokens(grpo_advantages(scores, gid), torch.ones(4, 2, dtype=bool))
    m = advantage_metrics(adv, torch.ones(4, 2, dtype=bool), scores, gid)
    close(m["adv/zero_std_group_frac"], 0.5)
    close(m["reward/score_mean"], 0.75)


def test_reinforce_pp_returns_carry_through_mask_holes():
    """§3.4 (verl after PR #7300): environment tokens between turns neither add reward nor reset
    the running return, so the first turn also receives the outcome (old: [0, 0, ., ., 1, 1])."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 1]])
    ret = discounted_returns(rewards, mask)
    close(ret[mask], [1, 1, 1, 1])
    close(ret[~mask], [0, 0])
    # gamma applies per valid token (the hole does not discount) and masked rewards are ignored
    leaky = torch.tensor([[0.0, 0, 5.0, 5.0, 0, 1]])
    close(discounted_returns(leaky, mask, gamma=0.5)[mask], [0.125, 0.25, 0.5, 1.0])


def test_reinforce_pp_baseline_singleton_groups_use_mean_zero():
    """§3.4: with one response per prompt the baseline is 0 (verl), not the response's own score
    (which made every advantage exactly 0)."""
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    mask = torch.ones(4, 3, dtype=torch.bool)
    adv = reinforce_pp_baseline_advantages(scores, torch.arange(4), mask)
    vals = scores.double().repeat_interleave(3)  # R broadcast to 3 tokens each, then whitened
    expected = (vals - vals.mean()) / (vals.var(unbiased=True) + 1e-8).sqrt()
    close(adv.flatten(), expected)
    assert adv.abs().max() > 0.5
    # groups of two or more keep subtracting their mean
    mixed = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 0.7]),
                                             torch.tensor([0, 0, 9]), torch.ones(3, 1, dtype=bool))
    c = torch.tensor([0.5, -0.5, 0.7], dtype=torch.float64)
    close(mixed.flatten(), (c - c.mean()) / (c.var(unbiased=True) + 1e-8).sqrt())
