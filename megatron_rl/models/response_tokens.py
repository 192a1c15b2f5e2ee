"""Where a batch's response tokens are: the ``(b, t)`` index tensors of a response mask, shared by
the plain head (:mod:`megatron_rl.models.heads`) and the fused one
(:mod:`megatron_rl.models.fused_head`).

Position convention: ``mask[b, t]`` is true where ``tokens[b, t]`` is a response token; its
log-prob comes from the hidden state at ``t - 1``, so position 0 is never marked.
"""

from __future__ import annotations

from typing import Sequence

import torch


def response_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, t)`` index tensors ``[N]`` of response tokens in ``mask [B, S]`` (row-major order).

    Position 0 cannot be scored (nothing precedes it), so it must not be marked.
    """
    if mask.dim() != 2:
        raise ValueError(f"response mask must be [B, S], got shape {tuple(mask.shape)}")
    b, t = mask.bool().nonzero(as_tuple=True)
    return b, t


def response_indices(masks: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`response_index` of every micro-batch mask ``[B_m, S_m]`` with a single host sync
    for the mini-batch (the token counts) instead of one ``nonzero`` sync per micro-batch; same
    order, same values. Masks of different shapes (token-budget micro-batches) are stacked
    padded with ``False``. The indices live on the masks' device."""
    if not masks:
        return []
    for m in masks:
        if m.dim() != 2:
            raise ValueError(f"response mask must be [B, S], got shape {tuple(m.shape)}")
    rows, cols = max(m.shape[0] for m in masks), max(m.shape[1] for m in masks)
    stacked = torch.stack([torch.nn.functional.pad(m.bool(), (0, cols - m.shape[1],
                                                               0, rows - m.shape[0]))
                           for m in masks])  # [M, B, S]
    counts = stacked.flatten(1).sum(1).tolist()  # the one host sync per mini-batch
    idx = torch.nonzero_static(stacked, size=sum(counts))  # [N, 3] (mb, b, t), no sync
    return [(part[:, 1], part[:, 2]) for part in idx.split(counts)]
