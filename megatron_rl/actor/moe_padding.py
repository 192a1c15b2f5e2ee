"""Which tokens megatron's MoE router counts: the ``padding_mask`` of our forward passes.

megatron-core 0.16.1 takes ``GPTModel.forward(..., padding_mask=)`` (``[B, S]`` bool, **True =
padding**) down to each ``MoELayer`` and its ``TopKRouter``: padded tokens are left out of the
load-balancing aux loss (``compute_routing_scores_for_aux_loss`` zeroes their scores and routing
entries, the token count is the valid count) and of the z-loss (a mean over valid tokens). Without
the mask both losses average over every token the model runs, so right padding and packing
fillers change the router's gradient whenever ``model.moe_aux_loss_coeff`` or
``model.moe_z_loss_coeff`` is > 0.

A row's valid tokens are its first ``L`` ones, ``L`` one past its last response token: what
packing and the token budget run of it (a row without response tokens has none). A micro-batch
without any valid token (a filler) keeps its first token as valid: megatron divides the aux loss
by the valid count, which would be 0/0 (NaN gradients) otherwise.

Dense models get no mask (nothing to route). Masks are built on the tokens' device without a host
sync.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.actor.precision import bare_model


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` (any DDP / ``Float16Module`` wrapper of a megatron model) has MoE
    layers."""
    cfg = getattr(bare_model(model), "config", None)
    return bool(getattr(cfg, "num_moe_experts", None))


def keep_one_valid_(pad: torch.Tensor) -> torch.Tensor:
    """``pad`` (bool, True = padding) with its first element made valid when every element is
    padding; in place, no host sync. Returns ``pad``."""
    flat = pad.view(-1)
    flat[0] = flat[0] & (~pad).any()  # unchanged when any element is valid
    return pad


def row_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool on ``mask``'s device, True = padding: the columns at or after one past each
    row's last response token (``mask [B, S]``, response tokens); see :func:`keep_one_valid_`."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    length = (mask.bool() * cols).amax(dim=1, keepdim=True)  # [B, 1]; 0: no response token
    return keep_one_valid_(cols.unsqueeze(0) > length)


def packed_padding_mask(total: int, used: int, device: torch.device) -> torch.Tensor:
    """``[1, total]`` bool on ``device``, True = padding: a packed row whose first ``used`` tokens
    are real and the rest the filler segment (at least the first token counts as valid)."""
    return (torch.arange(total, device=device) >= max(used, 1)).unsqueeze(0)


def padding_kwargs(model: torch.nn.Module, mask: torch.Tensor) -> dict[str, Any]:
    """``{"padding_mask": row_padding_mask(mask)}`` for an MoE ``model``; ``{}`` for a dense
    one. ``mask [B, S]`` of the rows the model is called with."""
    return {"padding_mask": row_padding_mask(mask)} if is_moe(model) else {}
