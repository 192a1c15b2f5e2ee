"""Advantage-weighted negative log-likelihood ``L_t = -A_t * logp_t`` (supervised warm start).

With ``A = 1`` on the answer tokens this is the SFT loss; it needs no old-policy pass (``old_logp``
is ignored), unlike the PPO surrogate whose gradient only equals the NLL gradient at ratio 1.
"""

from __future__ import annotations

from megatron_rl.loss.metrics import TokenStat
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.types import LossInputs, TokenLoss


def nll_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """Per-token ``-A * logp`` ``[B, T]``; logs the plain NLL ``-logp`` over valid tokens."""
    mask = inp.mask.bool()
    return TokenLoss(-inp.advantages * inp.logp,
                     {"sft/nll": TokenStat(-inp.logp.detach(), mask.float())})
