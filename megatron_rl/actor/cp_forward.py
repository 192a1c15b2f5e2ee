"""The model call and the output heads under context parallelism (``parallel.cp``): the
training-engine side of :mod:`megatron_rl.parallel.context_parallel` (layout and collectives)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist  # noqa: F401

from megatron_rl.parallel.context_parallel import (
    cp_group,
    cp_rank,
    cp_size,
    local_positions,
    padded_length,
    split_rows,
    sum_over_cp,
)

Tensor = torch.Tensor


def cp_model_forward(model_chunk: torch.nn.Module, tokens: Tensor, **kwargs: Any) -> Tensor:
    """Run ``model_chunk`` on this CP rank's slice of ``tokens [B, S]``: ``[B, S_p / cp]`` token
    ids and their global position ids (rotary positions come from megatron's own CP split of the
    table, which is the same split). ``kwargs`` go to the model; an MoE ``padding_mask [B, S]``
    is split the same way. Returns the stage's output for the local tokens."""
    cp, rank = cp_size(), cp_rank()
    local = split_rows(tokens, cp, rank)
    if kwargs.get("padding_mask") is not None:
        from megatron_rl.actor.moe_padding import keep_one_valid_

        kwargs["padding_mask"] = keep_one_valid_(split_rows(kwargs["padding_mask"], cp, rank,
                                                            fill=True))
    pos = local_positions(padded_length(tokens.shape[1], cp), cp, rank, tokens.device)
    return model_chunk(local, pos.unsqueeze(0).expand_as(local), None, **kwargs)


def cp_response_logprob_entropy(head: torch.nn.Module, hidden: Tensor, tokens: Tensor,
                                mask: Tensor, **kwargs: Any
                                ) -> tuple[Tensor, Tensor | None]:
    """Per-token log-prob and entropy ``[B, S]`` fp32 of response ``mask [B, S]`` from this CP
    rank's final hidden states ``hidden [S_p / cp, B, H]``, summed over CP (every rank returns
    the full values). The token at ``t`` is scored on the rank holding position ``t - 1``.
    ``kwargs``: :func:`megatron_rl.models.heads.response_logprob_entropy`'s (``index`` is
    recomputed for the local rows)."""
    from megatron_rl.models.heads import response_logprob_entropy

    cp, rank, group = cp_size(), cp_rank(), cp_group()
    bsz, seq = tokens.shape
    pos = local_positions(padded_length(seq, cp), cp, rank, tokens.device)  # [S_loc] global
    nxt = pos + 1  # the token each local position predicts
    valid = nxt < seq
    nxt_c = nxt.clamp_max(seq - 1)
    # local view in the head's convention: hidden[j] predicts column j + 1
    tok_loc = tokens.new_zeros(bsz, pos.numel() + 1)
    tok_loc[:, 1:] = tokens.index_select(1, nxt_c)
    mask_loc = torch.zeros(bsz, pos.numel() + 1, dtype=torch.bool, device=mask.device)
    mask_loc[:, 1:] = mask.bool().index_select(1, nxt_c) & valid
    kwargs.pop("index", None)
    logp, ent = response_logprob_entropy(head, hidden, tok_loc, mask_loc, **kwargs)
    return (sum_over_cp(to_next_columns(logp[:, 1:], seq, pos), group),
            None if ent is None else sum_over_cp(to_next_columns(ent[:, 1:], seq, pos), group))


def to_next_columns(x: Tensor, seq: int, pos: Tensor) -> Tensor:
    """``x [B, S_loc]`` computed at this rank's global positions ``pos [S_loc]`` -> ``[B, seq]``
    with the value of position ``p`` in column ``p + 1`` (the token it predicts; positions whose
    next token is past ``seq`` are dropped), zeros in the other columns."""
    nxt = pos + 1
    cols = torch.where(nxt < seq, nxt, torch.full_like(nxt, seq))  # column seq: a sink
    return x.new_zeros(x.shape[0], seq + 1).index_copy(1, cols, x)[:, :seq]


def cp_token_values(value_head: torch.nn.Module, hidden: Tensor, mask: Tensor) -> Tensor:
    """The critic's values ``[B, S]`` fp32 of the tokens in ``mask`` from this CP rank's hidden
    states ``[S_p / cp, B, H]`` (token ``t`` reads position ``t - 1``), summed over CP."""
    cp, rank = cp_size(), cp_rank()
    seq = mask.shape[1]
    pos = local_positions(padded_length(seq, cp), cp, rank, mask.device)
    v = value_head(hidden).squeeze(-1).transpose(0, 1).float()  # [B, S_loc]
    return sum_over_cp(to_next_columns(v, seq, pos), cp_group()) * mask.float()
