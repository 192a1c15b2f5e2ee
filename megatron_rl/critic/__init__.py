"""PPO critic on megatron-core: value model, GAE, clipped value loss."""

from megatron_rl.critic.gae import gae_advantages, masked_whiten
from megatron_rl.critic.value_loss import clipped_value_terms, value_loss_token_mean

__all__ = ["clipped_value_terms", "gae_advantages", "masked_whiten", "value_loss_token_mean"]
