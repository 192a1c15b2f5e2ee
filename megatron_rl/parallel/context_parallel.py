"""Context parallelism (``parallel.cp``): each sequence split over the CP ranks of a DP replica.

Layout (megatron-core's load-balanced split): a row of ``S`` tokens is right-padded to
``S_p = round_up(S, 2 * CP)`` and cut into ``2 * CP`` equal chunks; CP rank ``r`` holds chunks
``r`` and ``2 * CP - 1 - r`` (so every rank gets the same share of causal-attention work), i.e.
``S_p / CP`` tokens. Rotary positions are the global ones: megatron's ``RotaryEmbedding`` builds
the table for ``S_p`` positions and keeps this rank's two chunks (``get_pos_emb_on_this_cp_rank``).

What runs where:

* ``cp_model_forward`` (:mod:`megatron_rl.actor.cp_forward`) pads and splits a micro-batch's
  tokens and runs the model on this rank's ``[B, S_p / CP]`` slice; attention gathers K/V over
  the CP group (:class:`GatherSequence`, :mod:`megatron_rl.models.attention`) and masks on
  global positions.
* ``cp_response_logprob_entropy`` (same module) scores the response tokens whose predicting
  position is on this rank (vocab-parallel over TP as without CP) and sums the ``[B, S]``
  per-token values over the CP group (:class:`SumOverCP`). Every CP rank of a DP replica then
  holds the full per-token log-probs/entropies of its rows, so every token reduction of the
  loss (token counts, token-mean, sequence aggregation, Clip-Cov/KL-Cov selection, entropy
  diagnostics, metrics) sees exactly the tokens it sees at CP 1; the loss is computed
  identically on each CP rank.
* packed (THD) rows (:mod:`megatron_rl.actor.packing`): every sequence's segment is padded to a
  multiple of ``2 * CP`` and split the same way per segment (:func:`packed_local_positions`,
  Transformer Engine's THD CP layout); ``cu_seqlens`` stay the global ones, megatron's THD RoPE
  takes this rank's rotary chunks per segment.
* host syncs: the head finds this rank's response tokens with one ``nonzero`` per micro-batch
  (CP 1 has one per mini-batch); attention and the gathers have none.
* gradients: each CP rank's backward reaches only its own positions (plus, through the K/V
  gather, the keys/values it holds), so the parameter gradient of the replica is the **sum**
  over its CP ranks. Megatron DDP averages over DP x CP and megatron's schedule multiplies the
  loss by the CP size (``forward_step_calc_loss``), so with the loss's own ``dp`` factor
  (:attr:`megatron_rl.loss.context.ReductionContext.grad_scale`) the averaged gradient is the
  sum over the replicas, as at CP 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


# ---- layout ------------------------------------------------------------------------------------
def cp_group() -> Any:
    """Megatron's CP process group, or None when parallel_state is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_context_parallel_group()


def cp_size() -> int:
    """Context-parallel size of this rank's layout (1 without parallel_state)."""
    group = cp_group()
    return 1 if group is None else dist.get_world_size(group)


def cp_rank() -> int:
    """This rank's index in its CP group (0 without parallel_state)."""
    group = cp_group()
    return 0 if group is None else dist.get_rank(group)


def padded_length(seq: int, cp: int) -> int:
    """``seq`` rounded up to a multiple of ``2 * cp`` (``seq`` itself at CP 1)."""
    if cp <= 1:
        return seq
    m = 2 * cp
    return (seq + m - 1) // m * m


def local_positions(seq_padded: int, cp: int, rank: int, device: torch.device | str = "cpu"
                    ) -> Tensor:
    """Global positions ``[seq_padded / cp]`` (int64, ascending) of CP rank ``rank``'s tokens:
    chunks ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp`` equal chunks."""
    if seq_padded % (2 * cp):
        raise ValueError(f"sequence length {seq_padded} is not a multiple of 2 x cp = {2 * cp}")
    c = seq_padded // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def gathered_order(seq_local: int, cp: int, device: torch.device | str = "cpu") -> Tensor:
    """``[seq_local * cp]`` permutation putting the rank-ordered concatenation of every CP rank's
    tokens (what an all-gather returns) into global position order."""
    pos = torch.cat([local_positions(seq_local * cp, cp, r, device) for r in range(cp)])
    return torch.argsort(pos)


def split_rows(x: Tensor, cp: int, rank: int, fill: Any = 0) -> Tensor:
    """``x [B, S, ...]`` -> this rank's ``[B, S_p / cp, ...]`` (right-padded with ``fill``)."""
    seq = x.shape[1]
    sp = padded_length(seq, cp)
    if sp != seq:
        pad = x.new_full((x.shape[0], sp - seq, *x.shape[2:]), fill)
        x = torch.cat([x, pad], dim=1)
    return x.index_select(1, local_positions(sp, cp, rank, x.device))


# ---- collectives with the right backward -------------------------------------------------------
def _all_gather_seq(x: Tensor, group: Any) -> Tensor:
    """Rank-ordered concatenation along dim 0 of ``x`` from every rank of ``group``."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_seq(g: Tensor, group: Any) -> Tensor:
    """Sum of ``g [cp * n, ...]`` over ``group``, this rank's ``[n, ...]`` block (rank order).
    ``reduce_scatter_tensor`` on NCCL; gloo has none: an all-reduce, then the block."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = g.shape[0] // size
    g = g.contiguous()
    if g.is_cuda:
        out = g.new_empty((n, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g, group=group)
        return out
    dist.all_reduce(g, group=group)
    return g[rank * n:(rank + 1) * n].clone()


def packed_local_positions(seqlens: tuple[int, ...] | list[int], cp: int, rank: int,
                           device: torch.device | str = "cpu") -> Tensor:
    """Packed positions ``[T / cp]`` (int64, ascending) CP rank ``rank`` holds of a packed row
    whose segments have lengths ``seqlens`` (each a multiple of ``2 * cp``): chunks ``rank``
    and ``2 * cp - 1 - rank`` of every segment, as Transformer Engine's THD CP layout."""
    parts, start = [], 0
    for n in seqlens:
        if n % (2 * cp):
            raise ValueError(f"packed segment of {n} tokens is not a multiple of 2 x cp = "
                             f"{2 * cp}")
        parts.append(local_positions(n, cp, rank, device) + start)
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def packed_gathered_order(seqlens: tuple[int, ...] | list[int], cp: int,
                          device: torch.device | str = "cpu") -> Tensor:
    """The permutation putting an all-gather of every rank's packed tokens (rank order) into
    packed position order."""
    return torch.argsort(torch.cat([packed_local_positions(seqlens, cp, r, device)
                                    for r in range(cp)]))


class GatherSequence(torch.autograd.Function):
    """All-gather ``x [S_loc, ...]`` (this CP rank's tokens) into ``[S_loc * cp, ...]`` in global
    position order (``order``: the permutation, default :func:`gathered_order` of one row);
    backward: reduce-scatter (sum over the ranks whose queries used each key)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any, order: Tensor | None = None) -> Tensor:
        cp = dist.get_world_size(group)
        if order is None:
            order = gathered_order(x.shape[0], cp, x.device)
        ctx.group, ctx.order = group, order
        return _all_gather_seq(x, group).index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        unordered = torch.empty_like(grad).index_copy_(0, ctx.order, grad)
        return _reduce_scatter_seq(unordered, ctx.group), None, None


class SumOverCP(torch.autograd.Function):
    """Sum of per-token values over the CP group (each token is held by exactly one rank, zeros
    elsewhere). Backward: the identity, because every CP rank computes the same loss from the
    summed values, so each rank's gradient w.r.t. them is already the replica's."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def gather_sequence(x: Tensor, group: Any, order: Tensor | None = None) -> Tensor:
    """:class:`GatherSequence` (``[S_loc, ...]`` -> ``[S_loc * cp, ...]``, global order)."""
    return GatherSequence.apply(x, group, order)


def sum_over_cp(x: Tensor | None, group: Any) -> Tensor | None:
    """:class:`SumOverCP` of ``x`` (None stays None)."""
    return None if x is None else SumOverCP.apply(x, group)
