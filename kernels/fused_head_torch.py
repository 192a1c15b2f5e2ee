"""Chunked torch reference of the fused linear head + log-prob + entropy (CPU and fallback path).

Same math, tile for tile, as the Triton kernels in :mod:`kernels.fused_head_triton`; the
collectives live in the autograd Function (:mod:`kernels.fused_head`), not here. Per token ``n``
and vocab column ``v`` of this rank's shard, ``z[n, v] = fp32(h[n]) . fp32(w[v]) / T`` (fp32
accumulation of the input-dtype values, never rounded to the input dtype).

Forward (:func:`forward_stats`) walks vocab tiles of ``vocab_tile`` columns (and row chunks of
``chunk_size`` rows) with an online softmax that keeps four ``[N]`` fp32 statistics::

    m    running max of z                 s = sum exp(z - m)
    a    sum exp(z - m) (z - m)           zlab = z[label] (0 if the label is off this shard)

When the max grows from ``m`` to ``m'`` the old partials are rescaled (:func:`rescale_partials`)::

    s' = s e^(m - m')        a' = e^(m - m') (a + (m - m') s)

which is also how partials of different vocab splits (Triton) and of different TP ranks are
brought to one max before they are summed.

Backward (:func:`backward_grads`) recomputes each ``[rows, vocab_tile]`` logits tile and its
gradient with the foundation op's own step
(:meth:`megatron_rl.ops.vocab_parallel.VocabParallelSteps.grad_chunk`), rounds it to the input
dtype (what the unfused path's ``[N, V_local]`` logits gradient would be) and accumulates
``grad_hidden += dz @ w`` and ``grad_weight += dz^T @ h`` in fp32. The working set is a few fp32
``[rows, vocab_tile]`` tiles; nothing of size ``[N, V_local]`` is ever allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

from megatron_rl.ops.vocab_parallel import VocabParallelSteps

__all__ = [
    "DEFAULT_VOCAB_TILE",
    "OnlineStats",
    "backward_grads",
    "combine_partials",
    "forward_stats",
    "local_label_index",
    "rescale_partials",
]

_FP32 = torch.float32
DEFAULT_VOCAB_TILE = 4096


@dataclass
class OnlineStats:
    """Per-token online-softmax statistics of one vocab range; every field ``[N]`` fp32.

    ``a`` is None when the entropy is not requested.
    """

    m: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor | None
    zlab: torch.Tensor

    @staticmethod
    def empty(n: int, device: torch.device, with_entropy: bool) -> OnlineStats:
        """Statistics of an empty vocab range: ``m = -inf``, sums 0."""
        return OnlineStats(m=torch.full((n,), float("-inf"), dtype=_FP32, device=device),
                           s=torch.zeros(n, dtype=_FP32, device=device),
                           a=torch.zeros(n, dtype=_FP32, device=device) if with_entropy else None,
                           zlab=torch.zeros(n, dtype=_FP32, device=device))


# --------------------------------------------------------------------------------------------
# Small static steps (shared with the Triton launcher and the autograd Function)
# --------------------------------------------------------------------------------------------
def local_label_index(labels: torch.Tensor, vocab_start: int, v_local: int) -> torch.Tensor:
    """``[N]`` global ids -> ``[N]`` int64 column in this shard, ``-1`` where off the shard."""
    local = labels.long() - vocab_start
    in_shard = (local >= 0) & (local < v_local)
    return torch.where(in_shard, local, torch.full_like(local, -1))


def rescale_partials(m: torch.Tensor, s: torch.Tensor, a: torch.Tensor | None,
                     new_max: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Bring ``(s, a)`` taken relative to ``m`` to the larger max ``new_max`` (same shapes).

    ``s' = s e^(m - M)``, ``a' = e^(m - M) (a + (m - M) s)``. Partials of an empty range
    (``m = -inf``, ``s = 0``) stay 0 (the ``(m - M) s`` product is masked, not ``-inf x 0``).
    """
    delta = m - new_max
    scale = torch.exp(delta)
    s_new = s * scale
    if a is None:
        return s_new, None
    shift = torch.where(s > 0, delta, torch.zeros_like(delta)) * s
    return s_new, scale * (a + shift)


def combine_partials(m: torch.Tensor, s: torch.Tensor, a: torch.Tensor | None,
                     zlab: torch.Tensor) -> OnlineStats:
    """Merge ``P`` partial statistics ``[P, N]`` (disjoint vocab ranges) into ``[N]`` ones."""
    new_max = m.amax(dim=0)
    s_r, a_r = rescale_partials(m, s, a, new_max.unsqueeze(0))
    return OnlineStats(m=new_max, s=s_r.sum(0), a=None if a_r is None else a_r.sum(0),
                       zlab=zlab.sum(0))


def logits_tile(h32: torch.Tensor, weight_tile: torch.Tensor) -> torch.Tensor:
    """``[n, H]`` fp32, ``[c, H]`` any float -> raw fp32 logits ``[n, c]`` (not divided by T)."""
    return h32 @ weight_tile.to(_FP32).t()


def online_update(stats: OnlineStats, rows: slice, z: torch.Tensor,
                  label_col: torch.Tensor) -> None:
    """Fold one scaled fp32 logits tile ``z [n, c]`` into ``stats[rows]`` (in place).

    ``label_col [n]``: the label's column inside this tile, anything outside ``[0, c)`` if the
    label is not in it. ``z`` is overwritten (it becomes ``z - m'``).
    """
    m_old = stats.m[rows]
    m_new = torch.maximum(m_old, z.amax(dim=-1))
    in_tile = (label_col >= 0) & (label_col < z.size(1))
    picked = z.gather(1, torch.where(in_tile, label_col, 0).unsqueeze(1)).squeeze(1)
    stats.zlab[rows] += torch.where(in_tile, picked, torch.zeros_like(picked))
    s_old, a_old = rescale_partials(m_old, stats.s[rows], None if stats.a is None
                                    else stats.a[rows], m_new)
    shifted = z.sub_(m_new.unsqueeze(1))
    e = torch.exp(shifted)
    stats.s[rows] = s_old + e.sum(dim=-1)
    if stats.a is not None:
        stats.a[rows] = a_old + (e.mul_(shifted)).sum(dim=-1)
    stats.m[rows] = m_new


def _ranges(total: int, step: int | None) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` ranges of at most ``step`` (one range if ``step`` is None)."""
    step = total if not step else step
    for start in range(0, total, max(step, 1)):
        yield start, min(start + step, total)


# --------------------------------------------------------------------------------------------
# Forward / backward of one rank's shard (no collectives here)
# --------------------------------------------------------------------------------------------
def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                  temperature: float, with_entropy: bool, *, chunk_size: int | None = None,
                  vocab_tile: int | None = None) -> OnlineStats:
    """Local online-softmax statistics of this shard.

    Args:
        hidden: ``[N, H]`` fp32/bf16/fp16 response-token hidden states.
        weight: ``[V_local, H]`` this rank's vocab shard of the output weight.
        label_col: ``[N]`` int64 label column in this shard, ``-1`` off the shard.
        temperature: ``T > 0``.
        with_entropy: also accumulate ``a`` (needed for the entropy).
        chunk_size: rows per chunk (None = all rows); vocab_tile: columns per tile.

    Returns:
        :class:`OnlineStats` with ``[N]`` fp32 fields, relative to this shard's own max.
    """
    n, v_local = hidden.size(0), weight.size(0)
    stats = OnlineStats.empty(n, hidden.device, with_entropy)
    for r0, r1 in _ranges(n, chunk_size):
        h32 = hidden[r0:r1].to(_FP32)
        rows = slice(r0, r1)
        for c0, c1 in _ranges(v_local, vocab_tile or DEFAULT_VOCAB_TILE):
            z = logits_tile(h32, weight[c0:c1])
            if temperature != 1.0:
                z.div_(temperature)
            online_update(stats, rows, z, label_col[r0:r1] - c0)
    return stats


def backward_grads(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                   lse: torch.Tensor, mu: torch.Tensor | None, grad_logp: torch.Tensor | None,
                   grad_entropy: torch.Tensor | None, temperature: float, *,
                   need_hidden: bool = True, need_weight: bool = True,
                   chunk_size: int | None = None, vocab_tile: int | None = None,
                   ) -> Tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 ``(grad_hidden [N, H], grad_weight [V_local, H])`` of this shard (None if not needed).

    ``lse``, ``mu`` ``[N]`` fp32 global statistics (scaled units); ``grad_logp``,
    ``grad_entropy`` ``[N]`` fp32 upstream gradients or None. ``grad_hidden`` is this shard's
    partial sum over its vocab columns (the caller all-reduces it over TP).
    """
    n, v_local = hidden.size(0), weight.size(0)
    grad_h = torch.zeros(hidden.shape, dtype=_FP32, device=hidden.device) if need_hidden else None
    grad_w = torch.zeros(weight.shape, dtype=_FP32, device=weight.device) if need_weight else None
    round_to = hidden.dtype if hidden.dtype != _FP32 else None
    tile = min(vocab_tile or DEFAULT_VOCAB_TILE, max(v_local, 1))

    def cut(t: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
        return None if t is None else t[r0:r1]

    for r0, r1 in _ranges(n, chunk_size):
        h32 = hidden[r0:r1].to(_FP32)
        work = tuple(torch.empty(r1 - r0, tile, dtype=_FP32, device=hidden.device)
                     for _ in range(2))  # the two fp32 tiles grad_chunk works in
        for c0, c1 in _ranges(v_local, tile):
            w_tile = weight[c0:c1].to(_FP32)
            raw = h32 @ w_tile.t()                       # [rows, c] fp32, not divided by T
            dz = VocabParallelSteps.grad_chunk(
                raw, label_col[r0:r1], lse[r0:r1], cut(mu, r0, r1), cut(grad_logp, r0, r1),
                cut(grad_entropy, r0, r1), c0, temperature,
                (work[0][:, :c1 - c0], work[1][:, :c1 - c0]))
            if round_to is not None:                      # the unfused path's dtype for dlogits
                dz = dz.to(round_to).to(_FP32)
            if grad_h is not None:
                grad_h[r0:r1].addmm_(dz, w_tile)
            if grad_w is not None:
                grad_w[c0:c1].addmm_(dz.t(), h32)
        del work
    return grad_h, grad_w
