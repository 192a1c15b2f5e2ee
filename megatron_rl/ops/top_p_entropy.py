"""Top-p (nucleus) entropy over a vocab-parallel logits shard: SIREN's vocabulary mask.

Per token, with ``p = softmax(logits / T)`` over the whole (TP-sharded) vocabulary, the nucleus is
the set of tokens whose cumulative probability, counting every token at least as likely, stays
below ``top_p``::

    N   = { v : G(p_v) < top_p },     G(tau) = sum_{u : p_u >= tau} p_u
    q   = p restricted to N, renormalised          H_top_p = -sum_{v in N} q_v log q_v

(0 when ``N`` is empty: the most likely token alone reaches ``top_p``). This is the authors'
``efficient_top_p_sampling`` (Linn3a/siren@fa59a8dfbecf5c3936ed905d5902a06c0ca425ee:
``verl/verl/workers/actor/dp_actor.py``): sort, cumulative sum, keep the ranks before the first
cumulative value ``>= top_p``, renormalise (read, not copied). Differences: no ``1e-12`` guards
(exact formula), no top-k cap on the nucleus (theirs: ``entropy_topk`` = 10000 candidates), and
exactly tied probabilities at the boundary enter or leave the nucleus together (a sort keeps an
arbitrary subset of them).

TP-sharded vocabulary, no sort, no gather, no host sync. With ``m`` the global max logit and
``w = exp(z - m)`` (elementwise, so the same bits at every layout), ``G`` is monotone in
``tau``, so ``N = {v : key(w_v) > k*}`` where ``key`` is the float's bit pattern (monotone for
``w >= 0``) and ``k* = max {k : sum_{key(w_u) >= k} w_u >= top_p * S}``, ``S = sum w``. ``k*`` is
found bit by bit, most significant first: 31 rounds, each one ``[n]`` fp64 all-reduce (SUM) over
the TP group of the local sums of the candidate. Then ``S_N = sum_N w``, ``A_N = sum_N w (z - m)``
(one ``[n, 2]`` all-reduce) give ``H = log S_N - A_N / S_N``. Backward (no collective):
``dH/dz_j = -q_j (z_j - mu_N) / T`` on the nucleus, 0 elsewhere (``mu_N = m + A_N / S_N``), the
full-vocabulary entropy's gradient restricted to ``N``; the nucleus itself is not differentiated
(as in the authors' code).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

_FP32 = torch.float32
_BITS = 31  # w >= 0: the sign bit is 0


def _shifted(logits: torch.Tensor, m: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n, V_local]`` fp32 ``z - m`` with ``z = logits / T`` (``m`` ``[n]`` fp32)."""
    z = logits.to(_FP32)
    if temperature != 1.0:
        z = z / temperature
    return z - m.unsqueeze(-1)


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def nucleus_threshold(w: torch.Tensor, top_p: float, group) -> torch.Tensor:
    """``k*`` ``[n]`` int32 (see module docstring) of this shard's ``w`` ``[n, V_local]`` fp32
    (``exp(z - m)``); tokens with ``key(w) > k*`` form the nucleus. 32 all-reduces over
    ``group`` (S, then one per bit), each ``[n]`` fp64."""
    keys = w.view(torch.int32)
    w64 = w.double()
    target = _all_reduce(w64.sum(dim=-1), group) * top_p
    prefix = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
    for bit in range(_BITS - 1, -1, -1):
        cand = prefix | (1 << bit)
        mass = torch.where(keys >= cand.unsqueeze(-1), w64, 0.0).sum(dim=-1)
        prefix = torch.where(_all_reduce(mass, group) >= target, cand, prefix)
    return prefix


class TopPEntropy(torch.autograd.Function):
    """Autograd wrapper of :func:`vocab_parallel_top_p_entropy`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_p: float, group, temperature: float):
        m = logits.detach().amax(dim=-1).to(_FP32)
        if temperature != 1.0:
            m = m / temperature
        m = _all_reduce(m, group, dist.ReduceOp.MAX)
        shifted = _shifted(logits.detach(), m, temperature)
        w = torch.exp(shifted)
        kstar = nucleus_threshold(w, top_p, group)
        inside = w.view(torch.int32) > kstar.unsqueeze(-1)
        wn = torch.where(inside, w, 0.0)
        stats = _all_reduce(torch.stack([wn.sum(-1), (wn * shifted).sum(-1)], dim=-1), group)
        s_n, a_n = stats[:, 0], stats[:, 1]
        empty = s_n <= 0
        safe = torch.where(empty, torch.ones_like(s_n), s_n)
        entropy = torch.where(empty, torch.zeros_like(s_n), torch.log(safe) - a_n / safe)
        ctx.save_for_backward(logits, m, kstar, safe, a_n / safe, empty)
        ctx.temperature = temperature
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entropy):
        logits, m, kstar, s_n, mean_shift, empty = ctx.saved_tensors
        shifted = _shifted(logits, m, ctx.temperature)
        w = torch.exp(shifted)
        inside = (w.view(torch.int32) > kstar.unsqueeze(-1)) & ~empty.unsqueeze(-1)
        q = torch.where(inside, w / s_n.unsqueeze(-1), 0.0)
        grad = -q * (shifted - mean_shift.unsqueeze(-1)) * grad_entropy.to(_FP32).unsqueeze(-1)
        if ctx.temperature != 1.0:
            grad = grad / ctx.temperature
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_top_p_entropy(logits: torch.Tensor, top_p: float, group=None, *,
                                 temperature: float = 1.0, chunk_size: int | None = None
                                 ) -> torch.Tensor:
    """Nucleus entropy ``[N]`` fp32 of ``softmax(logits / T)`` (module docstring).

    ``logits``: ``[N, V_local]`` this rank's vocabulary shard (any float dtype); ``group``: the
    TP group (None: one shard). ``top_p`` in ``(0, 1)``. ``chunk_size``: rows per pass (bounds
    the fp32 working set to a few ``chunk_size x V_local`` buffers). Differentiable w.r.t.
    ``logits``. On the logits' device; no host sync.
    """
    if not 0.0 < top_p < 1.0:
        raise ValueError(f"top_p must be in (0, 1), got {top_p!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    step = chunk_size or max(n, 1)
    parts = [TopPEntropy.apply(logits[s:s + step], float(top_p), group, float(temperature))
             for s in range(0, n, step)]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=_FP32)
