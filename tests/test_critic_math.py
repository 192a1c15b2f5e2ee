"""GAE over multi-turn reply tokens, masked whitening and the clipped value loss against
hand-computed tables (issue 15)."""

import pytest
import torch

from megatron_rl.critic.gae import gae_advantages, masked_whiten
from megatron_rl.critic.value_loss import clipped_value_terms, value_loss_token_mean


def test_gae_skips_environment_tokens_hand_table():
    # prompt | reply r1 r2 | env | reply r4 r5 ; turn rewards 0.5 (end of turn 1), 1.0 (turn 2)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.2, 0.4, 7.0, 0.6, 0.8]])  # 9 and 7 sit on masked positions
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand (gamma*lam = 0.72; the env token is transparent):
    # t5: 1.0 - 0.8 = 0.2
    # t4: 0.9*0.8 - 0.6 = 0.12;           A = 0.12 + 0.72*0.2 = 0.264
    # t2: 0.5 + 0.9*0.6 - 0.4 = 0.64;     A = 0.64 + 0.72*0.264 = 0.83008
    # t1: 0.9*0.4 - 0.2 = 0.16;           A = 0.16 + 0.72*0.83008 = 0.7576576
    want = torch.tensor([[0.0, 0.7576576, 0.83008, 0.0, 0.264, 0.2]])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.9576576, 1.23008, 0.0, 0.864, 1.0]]),
                               atol=1e-6, rtol=0)


def test_gae_gamma_lambda_one_is_return_minus_value():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.0, 0.25, 0.5, 0.75, 0.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.75, 0.5, 0.25, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]))


def test_masked_whiten_hand_table():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, unbiased variance (1 + 0 + 1) / 2 = 1
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]),
                               atol=1e-6, rtol=0)


def test_clipped_value_loss_hand_table():
    vpred = torch.tensor([[1.0, 0.9, 2.0]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.0, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    per_tok, clipped = clipped_value_terms(vpred, old, returns, 0.2)
    # tok0: clip 0.7 -> max(1.00, 0.49) = 1.00 (unclipped larger)
    # tok1: clip 0.7 -> max(0.01, 0.09) = 0.09 (clipped larger)
    # tok2: clip 0.7 -> max(1.00, 5.29) = 5.29 (masked out below)
    torch.testing.assert_close(per_tok, torch.tensor([[1.0, 0.09, 5.29]]))
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 1.0, 1.0]]))
    loss, clipfrac = value_loss_token_mean(vpred, old, returns, mask, 0.2, torch.tensor(2.0))
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.09) / 2)  # verl: 0.5 * token-mean
    assert clipfrac.item() == pytest.approx(0.5)


def test_value_loss_gradient_only_through_unclipped_when_clipped_wins():
    vpred = torch.tensor([[0.9]], requires_grad=True)
    loss, _ = value_loss_token_mean(vpred, torch.tensor([[0.5]]), torch.tensor([[1.0]]),
                                    torch.ones(1, 1, dtype=torch.bool), 0.2, torch.tensor(1.0))
    loss.backward()
    # the clipped branch (constant 0.7) is the max: no gradient reaches vpred
    assert vpred.grad.item() == 0.0
