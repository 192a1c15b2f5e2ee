"""Per-token log-prob and full-vocabulary entropy over a vocab-parallel logits shard.

Rank ``r`` of the tensor-parallel group holds ``logits[:, r*V_local:(r+1)*V_local]`` (fp32, bf16
or fp16); the full vocabulary is never gathered. Per token, with ``z = logits.float() / T``::

    m    = max_v z                    local max       -> all-reduce MAX   ([N])
    S    = sum_v exp(z - m)           local sums      -> all-reduce SUM   ([N, 3], one call
    A    = sum_v exp(z - m) (z - m)                                        for all three;
    zlab = z[label] if label is in this shard else 0                       [N, 2] without A)
    lse  = m + log S;   logp = zlab - lse;   H = lse - mu = log S - A / S,   mu = sum_v p z

Two collectives per call, whatever the chunking. The backward needs none:

    dlogp/dz_j = onehot_j - p_j          dH/dz_j = -p_j (z_j - mu)

so ``ctx.save_for_backward(logits, labels, lse, mu)`` is the whole memory story: the input logits
themselves (same storage, no copy) plus ``[N]`` statistics; ``p`` is recomputed in backward. With
``chunk_size`` both passes walk ``chunk_size`` rows at a time, so the transient fp32 working set is
about ``2 x chunk_size x V_local`` floats (plus the ``[N, V_local]`` gradient in the input dtype).

Compare the anchors (verl, slime): they gather or keep ``softmax``, ``log_softmax`` and their
product as fp32 ``[tokens, V/TP]`` buffers for backward, and run over prompt tokens too. Callers of
this op pass response tokens only.

Logits must be finite (as in megatron-core's ``cross_entropy.py``): a ``-inf`` column gives a NaN
entropy here exactly as it does in ``-(softmax * log_softmax).sum()``.

Shape agreement across TP ranks is the caller's contract. :func:`check_tp_consistency` checks it
once per step (host sync); inside the op a mismatch fails in the first collective (gloo aborts
with a size-mismatch error; under NCCL the watchdog aborts once the process group's timeout
expires) -- it never hangs forever, because every process group here has a finite timeout.

This op starts from logits that the caller already has; the fused hidden-states x output-weight
kernel (``kernels/``) computes the same statistics without materialising the logits at all.
"""

from __future__ import annotations

import sys
from typing import Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = [
    "VocabParallelLogProbEntropy",
    "check_tp_consistency",
    "naive_logprob_entropy",
    "reference_logprob_entropy",
    "vocab_parallel_logprob_entropy",
]

_FP32 = torch.float32


# --------------------------------------------------------------------------------------------
# Static steps (shared by the chunked and unchunked paths, and readable one at a time)
# --------------------------------------------------------------------------------------------
class VocabParallelSteps:
    """Small static steps of the forward and backward; all math in fp32."""

    @staticmethod
    def workspace(n_rows: int, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Two fp32 ``[n_rows, V_local]`` work buffers, made once per call and reused by chunks."""
        shape = (n_rows, logits.size(-1))
        return (torch.empty(shape, dtype=_FP32, device=logits.device),
                torch.empty(shape, dtype=_FP32, device=logits.device))

    @staticmethod
    def scaled_fp32(logits: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
        """``[n, V_local]`` any float -> ``out`` (fp32 ``[n, V_local]``) ``= logits / T``.

        Always written into the work buffer (also for fp32 input), so the callers may work in
        place on it without touching the saved input.
        """
        z = out.copy_(logits)
        if temperature != 1.0:
            z.div_(temperature)
        return z

    @staticmethod
    def local_max(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``[n, V_local]`` -> ``[n]`` fp32 ``max_v logits / T``, without an fp32 copy.

        Conversion to fp32 and division by ``T > 0`` are monotonic, so the max of the raw
        logits, converted, equals the max of the converted logits.
        """
        m = logits.amax(dim=-1).to(_FP32)
        if temperature != 1.0:
            m = m / temperature
        return m

    @staticmethod
    def predicted_logits(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                         temperature: float) -> torch.Tensor:
        """``[N, V_local]``, ``[N]`` global ids -> ``[N]`` fp32 ``z[label]``, 0 off this shard."""
        v_local = logits.size(-1)
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        local = torch.where(in_shard, local, torch.zeros_like(local))
        rows = torch.arange(logits.size(0), device=logits.device)
        z_label = logits[rows, local].to(_FP32)
        if temperature != 1.0:
            z_label = z_label / temperature
        return torch.where(in_shard, z_label, torch.zeros_like(z_label))

    @staticmethod
    def local_sums(logits: torch.Tensor, global_max: torch.Tensor, temperature: float,
                   out: torch.Tensor, work: Tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write the local ``S = sum exp(z - m)`` (and ``A = sum exp(z - m)(z - m)``) of a chunk.

        ``logits`` ``[n, V_local]``, ``global_max`` ``[n]`` fp32, ``out`` ``[n, 1 or 2]`` fp32 view;
        column 1 (``A``) is filled only when ``out`` has two columns. ``work``: two fp32 buffers
        of at least ``n`` rows (the only ``[n, V_local]`` memory used).
        """
        n = logits.size(0)
        shifted = VocabParallelSteps.scaled_fp32(logits, temperature, work[0][:n])
        shifted.sub_(global_max.unsqueeze(-1))
        exp_shifted = torch.exp(shifted, out=work[1][:n])
        torch.sum(exp_shifted, dim=-1, out=out[:, 0])
        if out.size(1) > 1:
            torch.sum(shifted.mul_(exp_shifted), dim=-1, out=out[:, 1])

    @staticmethod
    def logprob_entropy(global_max: torch.Tensor, sums: torch.Tensor, z_label: torch.Tensor):
        """Global stats -> ``(logp, lse, entropy, mu)``, all ``[N]`` fp32.

        ``sums`` is ``[N, 1]`` (``S``) or ``[N, 2]`` (``S, A``); without ``A`` the entropy and
        ``mu = sum_v p z = m + A / S`` are None.
        """
        log_s = torch.log(sums[:, 0])
        lse = global_max + log_s
        logp = z_label - lse
        if sums.size(1) == 1:
            return logp, lse, None, None
        mean_shifted = sums[:, 1] / sums[:, 0]          # sum_v p (z - m)
        return logp, lse, log_s - mean_shifted, global_max + mean_shifted

    @staticmethod
    def grad_chunk(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                   mu: torch.Tensor | None, grad_logp: torch.Tensor | None,
                   grad_entropy: torch.Tensor | None, vocab_start: int, temperature: float,
                   work: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """fp32 ``[n, V_local]`` gradient w.r.t. the logits of one chunk of rows.

        ``grad = (g_lp (onehot - p) - g_H p (z - mu)) / T`` with ``p = exp(z - lse)`` recomputed;
        a ``None`` upstream gradient skips its term. Computed in (and returned as a view of) one
        of the two ``work`` buffers.
        """
        n = logits.size(0)
        z = VocabParallelSteps.scaled_fp32(logits, temperature, work[0][:n])
        p = torch.sub(z, lse.unsqueeze(-1), out=work[1][:n]).exp_()
        if grad_entropy is not None:
            # coef = g_lp + g_H (z - mu);  grad = -p * coef  (+ g_lp at the label, below)
            coef = z.sub_(mu.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_logp is not None:
                coef.add_(grad_logp.unsqueeze(-1))
            grad = coef.mul_(p).neg_()
        else:
            grad = p.mul_(grad_logp.neg().unsqueeze(-1))
        if grad_logp is not None:
            local = labels - vocab_start
            in_shard = (local >= 0) & (local < grad.size(-1))
            rows = torch.arange(grad.size(0), device=grad.device)
            local = torch.where(in_shard, local, torch.zeros_like(local))
            grad[rows, local] += torch.where(in_shard, grad_logp, torch.zeros_like(grad_logp))
        if temperature != 1.0:
            grad.div_(temperature)
        return grad


def _row_chunks(n: int, chunk_size: int | None):
    """Yield ``(start, stop)`` row ranges of at most ``chunk_size`` rows (one range if None)."""
    step = n if not chunk_size else chunk_size
    for start in range(0, n, max(step, 1)):
        yield start, min(start + step, n)


# --------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------
class VocabParallelLogProbEntropy(torch.autograd.Function):
    """Thin autograd wrapper; see the module docstring for the math and the memory contract."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, tp_size: int,
                vocab_start: int, temperature: float, compute_entropy: bool,
                entropy_grad: bool, chunk_size: int | None):
        steps = VocabParallelSteps
        n = logits.size(0)
        chunks = list(_row_chunks(n, chunk_size))

        # Pass 1: local max, then the max over the TP group.
        global_max = torch.empty(n, dtype=_FP32, device=logits.device)
        for s, e in chunks:
            global_max[s:e] = steps.local_max(logits[s:e], temperature)
        if tp_size > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)

        # Pass 2: local [S, A] with the global max, plus the label logit; one SUM for all three.
        n_stats = 2 if compute_entropy else 1
        stats = torch.empty(n, n_stats + 1, dtype=_FP32, device=logits.device)
        work = steps.workspace(chunks[0][1] if chunks else 0, logits)
        for s, e in chunks:
            steps.local_sums(logits[s:e], global_max[s:e], temperature, stats[s:e, :n_stats],
                             work)
        del work
        stats[:, n_stats] = steps.predicted_logits(logits, labels, vocab_start, temperature)
        if tp_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

        logp, lse, entropy, mu = steps.logprob_entropy(global_max, stats[:, :n_stats],
                                                       stats[:, n_stats])
        track_entropy = compute_entropy and entropy_grad

        # The whole memory story: the input itself (no copy) + [N] stats + labels.
        if track_entropy:
            ctx.save_for_backward(logits, labels, lse, mu)
        else:
            ctx.save_for_backward(logits, labels, lse)
        ctx.track_entropy = track_entropy
        ctx.vocab_start, ctx.temperature, ctx.chunk_size = vocab_start, temperature, chunk_size
        ctx.set_materialize_grads(False)
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        if ctx.track_entropy:
            logits, labels, lse, mu = ctx.saved_tensors
        else:
            (logits, labels, lse), mu, grad_entropy = ctx.saved_tensors, None, None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        chunks = list(_row_chunks(logits.size(0), ctx.chunk_size))
        work = VocabParallelSteps.workspace(chunks[0][1] if chunks else 0, logits)
        args = (ctx.vocab_start, ctx.temperature, work)

        def rows(t: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
            return None if t is None else t[s:e].to(_FP32)

        if len(chunks) == 1:   # one work buffer becomes the gradient; free the other first
            grad = VocabParallelSteps.grad_chunk(logits, labels, lse, mu, rows(grad_logp, 0, None),
                                                 rows(grad_entropy, 0, None), *args)
            del work, args
            grad = grad.to(logits.dtype)
        else:
            grad = torch.empty_like(logits)
            for s, e in chunks:
                grad[s:e] = VocabParallelSteps.grad_chunk(
                    logits[s:e], labels[s:e], lse[s:e], rows(mu, s, e), rows(grad_logp, s, e),
                    rows(grad_entropy, s, e), *args)
            del work, args
        return (grad,) + (None,) * 8


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------
def _default_tp_group():
    """Megatron's TP group if megatron ``parallel_state`` is initialised, else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_group()
    return None


def _group_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _validate(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
              vocab_global: int, chunk_size: int | None) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local] (2-D), got shape {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() \
            or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got "
                        f"{getattr(labels, 'dtype', type(labels))}")
    if tuple(labels.shape) != (logits.size(0),):
        raise ValueError(f"labels must have shape (N,) = ({logits.size(0)},) to match logits "
                         f"{tuple(logits.shape)}, got {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    check_label_range(labels, vocab_global)


def check_label_range(labels: torch.Tensor, vocab_global: int) -> None:
    """Labels ``[N]`` must lie in ``[0, vocab_global)``. CPU labels: a ``ValueError`` now; device
    labels: an async device assert (no host sync; the error surfaces at the next sync)."""
    if labels.numel() == 0:
        return
    if labels.device.type != "cpu":  # no host sync: the check runs on the device stream
        torch._assert_async(((labels >= 0) & (labels < vocab_global)).all(),
                            f"labels out of range [0, {vocab_global})")
    else:
        lo, hi = int(labels.min()), int(labels.max())  # device-spy: ok (CPU labels only)
        if lo < 0 or hi >= vocab_global:
            raise ValueError(f"labels out of range [0, {vocab_global}) (V_global = V_local x TP): "
                             f"min {lo}, max {hi}")


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
    vocab_start: int | None = None,
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of ``labels`` and entropy of ``softmax(logits / T)`` over the full vocab.

    Args:
        logits: ``[N, V_local]`` fp32/bf16/fp16, this rank's vocab shard, response tokens only.
        labels: ``[N]`` integer global vocab ids in ``[0, V_local x TP)``.
        group: tensor-parallel process group; default megatron's TP group when megatron
            ``parallel_state`` is initialised, else None (one shard, no collectives).
        temperature: ``T > 0``, applied inside (no scaled copy is made by the caller).
        compute_entropy: False skips the entropy statistic and returns ``None`` for it.
        entropy_grad: False returns the entropy as a non-differentiable tensor (no backward work
            for it). A loss that uses the entropy (bonus, adaptive control) must leave this True.
        chunk_size: process this many rows at a time in forward and backward (bounds the fp32
            working set to ~``2 x chunk_size x V_local``); None = all rows at once.
        vocab_start: global id of this shard's first column; default ``tp_rank x V_local``.

    Returns:
        ``(logp [N] fp32, entropy [N] fp32 or None)``; the gradient w.r.t. ``logits`` comes back
        in the logits' dtype.
    """
    if group is None:
        group = _default_tp_group()
    tp_size, tp_rank = _group_size_rank(group)
    v_local = logits.size(-1) if isinstance(logits, torch.Tensor) and logits.dim() else 0
    _validate(logits, labels, temperature, v_local * tp_size, chunk_size)
    if vocab_start is None:
        vocab_start = tp_rank * v_local
    return VocabParallelLogProbEntropy.apply(
        logits, labels, group, tp_size, int(vocab_start), float(temperature),
        bool(compute_entropy), bool(entropy_grad), chunk_size)


def check_tp_consistency(n_tokens: int, v_local: int, group=None) -> None:
    """Raise on every rank if the TP ranks disagree on ``(n_tokens, v_local)``.

    Once per step, outside the op (one all-gather of two ints; a host sync). Inside the op a
    mismatch would only surface as a failed collective.
    """
    if group is None:
        group = _default_tp_group()
    tp_size, tp_rank = _group_size_rank(group)
    if tp_size == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([int(n_tokens), int(v_local)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(tp_size)]
    dist.all_gather(gathered, mine, group=group)
    shapes = [tuple(int(x) for x in t.tolist()) for t in gathered]
    if len(set(shapes)) > 1:
        ranks = dist.get_process_group_ranks(group)
        detail = ", ".join(f"tp_rank {r} (global rank {g}): [N={n}, V_local={v}]"
                           for r, (g, (n, v)) in enumerate(zip(ranks, shapes, strict=True)))
        raise ValueError(f"tensor-parallel ranks disagree on the logits shard shape "
                         f"(this is tp_rank {tp_rank}): {detail}")


def reference_logprob_entropy(full_logits: torch.Tensor, labels: torch.Tensor,
                              temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Single-process fp32 autograd reference: ``[N, V]``, ``[N]`` -> ``(logp [N], H [N])``."""
    logp_all = torch.log_softmax(full_logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def naive_logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None,
                          temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the anchors do: gather the full vocab, ``log_softmax``, ``softmax * log_softmax``.

    ``[N, V_local]`` shard -> all-gather -> ``[N, V]`` on every rank (for benchmarks only). The
    gather is not differentiated back to the shard (benchmarks call it with TP = 1).
    """
    tp_size, _ = _group_size_rank(group)
    if tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    z = logits.float() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(z, dim=-1)
    entropy = -(probs * logp_all).sum(-1)
    return logp, entropy
