"""Row-chunked fused head: the shared chunk driver and its torch elementwise pass (CPU path).

One algorithm for every backend; only the elementwise pass differs (torch here, Triton in
:mod:`megatron_rl.kernels.fused_head_triton`). The collectives live in the autograd Function
(:mod:`megatron_rl.kernels.fused_head`), not here. Rows are processed ``chunk_rows`` at a time:

Forward (:func:`forward_stats`), per row chunk ``c``::

    z_c = h_c @ W^T                  one GEMM in the input dtype (bf16 in, fp32 accumulate, bf16
                                     out -- exactly the logits the unfused ``output_layer`` returns)
    (m, s, a, zlab)[c]               one elementwise pass over z_c, fp32 math:
        m = max_v z/T,  s = sum_v e^(z/T - m),  a = sum_v e^(z/T - m)(z/T - m),  zlab = z[label]/T

Backward (:func:`backward_grads`), per row chunk ``c``: recompute ``z_c`` into the same buffer, one
elementwise pass overwrites it in place with ``dz = (g_lp (onehot - p) - g_H p (z/T - mu)) / T``
(fp32 math, stored in the input dtype -- the unfused path's logits-gradient dtype and the
tensor-core operand), then the two gradient GEMMs::

    grad_hidden[c]  = dz_c @ W          complete per chunk, written straight into the output
    grad_weight    += dz_c^T @ h_c      accumulated in fp32: into ``weight.main_grad`` (megatron
                                        DDP's buffer) when given, else into the fp32 output

Nothing is atomic; the chunks run in a fixed order, so two backward passes are bit-equal. The
working set is one ``[chunk_rows, V_local]`` buffer in the input dtype (plus, on this torch path
only, fp32 temporaries of the same shape); :func:`auto_chunk_rows` sizes it from a memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Tuple

import torch

from megatron_rl.ops.vocab_parallel import VocabParallelSteps

__all__ = [
    "ChunkOps",
    "OnlineStats",
    "TorchChunkOps",
    "auto_chunk_rows",
    "backward_grads",
    "forward_stats",
    "local_label_index",
    "rescale_partials",
]

_FP32 = torch.float32
#: Fraction of the ``[N, V_local]`` logits buffer (input dtype) the chunk buffer may take.
CHUNK_BUDGET = 0.08
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS, ROW_ALIGN = 256, 4096, 64


@dataclass
class OnlineStats:
    """Per-token softmax statistics of one vocab range; every field ``[N]`` fp32.

    ``a`` is None when the entropy is not requested.
    """

    m: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor | None
    zlab: torch.Tensor

    @staticmethod
    def empty(n: int, device: torch.device, with_entropy: bool) -> OnlineStats:
        """Uninitialised ``[n]`` fp32 statistics (every row is written by one chunk pass)."""
        def new() -> torch.Tensor:
            return torch.empty(n, dtype=_FP32, device=device)
        return OnlineStats(m=new(), s=new(), a=new() if with_entropy else None, zlab=new())

    def rows(self, r0: int, r1: int) -> OnlineStats:
        """Views of rows ``[r0, r1)``."""
        return OnlineStats(self.m[r0:r1], self.s[r0:r1],
                           None if self.a is None else self.a[r0:r1], self.zlab[r0:r1])


# --------------------------------------------------------------------------------------------
# Small static steps (shared with the Triton backend and the autograd Function)
# --------------------------------------------------------------------------------------------
def local_label_index(labels: torch.Tensor, vocab_start: int, v_local: int) -> torch.Tensor:
    """``[N]`` global ids -> ``[N]`` int64 column in this shard, ``-1`` where off the shard."""
    local = labels.long() - vocab_start
    in_shard = (local >= 0) & (local < v_local)
    return torch.where(in_shard, local, torch.full_like(local, -1))


def rescale_partials(m: torch.Tensor, s: torch.Tensor, a: torch.Tensor | None,
                     new_max: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Bring ``(s, a)`` taken relative to ``m`` to the larger max ``new_max`` (same shapes).

    ``s' = s e^(m - M)``, ``a' = e^(m - M) (a + (m - M) s)`` -- how the partial statistics of
    different TP ranks are brought to one max before they are summed.
    """
    delta = m - new_max
    scale = torch.exp(delta)
    s_new = s * scale
    if a is None:
        return s_new, None
    shift = torch.where(s > 0, delta, torch.zeros_like(delta)) * s
    return s_new, scale * (a + shift)


def auto_chunk_rows(n: int, v_local: int, itemsize: int, *, extra_fp32_buffers: int = 0,
                    budget: float = CHUNK_BUDGET) -> int:
    """Rows per chunk so the chunk buffers stay within ``budget`` of the ``[N, V_local]`` logits.

    Per row the buffers cost ``V_local x (itemsize + 4 x extra_fp32_buffers)`` bytes against a
    logits buffer of ``N x V_local x itemsize``. Rounded down to a multiple of 64 rows, clamped to
    ``[256, 4096]`` (GEMM efficiency below, no gain above) and to ``N``.
    """
    if n <= MIN_CHUNK_ROWS:
        return max(n, 1)
    per_row = itemsize + 4 * extra_fp32_buffers
    rows = int(budget * n * itemsize / per_row) // ROW_ALIGN * ROW_ALIGN
    return max(1, min(n, max(MIN_CHUNK_ROWS, min(MAX_CHUNK_ROWS, rows))))


def row_ranges(n: int, step: int) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` row ranges of at most ``step`` rows."""
    for start in range(0, n, max(step, 1)):
        yield start, min(start + step, n)


# --------------------------------------------------------------------------------------------
# The elementwise pass, by backend
# --------------------------------------------------------------------------------------------
class ChunkOps(Protocol):
    """The three backend-specific steps of the chunk loop."""

    #: fp32 temporaries of chunk size the elementwise pass allocates (for :func:`auto_chunk_rows`)
    extra_fp32_buffers: int

    def stats(self, z: torch.Tensor, label_col: torch.Tensor, temperature: float,
              out: OnlineStats) -> None:
        """Fill ``out`` (``[c]`` fp32 views) from the chunk logits ``z [c, V_local]``."""

    def dlogits_(self, z: torch.Tensor, label_col: torch.Tensor, lse: torch.Tensor,
                 mu: torch.Tensor | None, grad_logp: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None, temperature: float) -> None:
        """Overwrite ``z [c, V_local]`` (input dtype) with the logits gradient, in place."""

    def wgrad_(self, acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
        """``acc += dz^T @ h`` with fp32 accumulation (``acc`` fp32 ``[V_local, H]``)."""


class TorchChunkOps:
    """The elementwise pass in plain torch, with the foundation op's own steps."""

    extra_fp32_buffers = 2

    def stats(self, z, label_col, temperature, out: OnlineStats) -> None:
        zf = z.to(_FP32)
        if temperature != 1.0:
            zf = zf / temperature
        torch.amax(zf, dim=1, out=out.m)
        in_shard = label_col >= 0
        picked = zf.gather(1, torch.where(in_shard, label_col, 0).unsqueeze(1)).squeeze(1)
        torch.where(in_shard, picked, torch.zeros_like(picked), out=out.zlab)
        shifted = zf.sub_(out.m.unsqueeze(1))        # z is a scratch buffer: in place is fine
        e = torch.exp(shifted)
        torch.sum(e, dim=1, out=out.s)
        if out.a is not None:
            torch.sum(e.mul_(shifted), dim=1, out=out.a)

    def dlogits_(self, z, label_col, lse, mu, grad_logp, grad_entropy, temperature) -> None:
        c, v = z.shape
        work = (torch.empty(c, v, dtype=_FP32, device=z.device),
                torch.empty(c, v, dtype=_FP32, device=z.device))
        grad = VocabParallelSteps.grad_chunk(z, label_col, lse, mu, grad_logp, grad_entropy, 0,
                                             temperature, work)
        z.copy_(grad)

    def wgrad_(self, acc, dz, h) -> None:
        if dz.dtype == acc.dtype:
            acc.addmm_(dz.t(), h)
        else:                      # CPU has no bf16 x bf16 -> fp32 GEMM: upcast the chunk only
            acc.addmm_(dz.t().to(acc.dtype), h.to(acc.dtype))


# --------------------------------------------------------------------------------------------
# The chunk driver (no collectives here)
# --------------------------------------------------------------------------------------------
def _chunk_rows(n: int, v_local: int, hidden: torch.Tensor, ops: ChunkOps,
                chunk_size: int | None) -> int:
    if chunk_size:
        return max(1, min(chunk_size, max(n, 1)))
    return auto_chunk_rows(n, v_local, hidden.element_size(),
                           extra_fp32_buffers=ops.extra_fp32_buffers)


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                  temperature: float, with_entropy: bool, ops: ChunkOps, *,
                  chunk_size: int | None = None) -> OnlineStats:
    """Local softmax statistics of this shard, relative to its own per-row max.

    Args:
        hidden: ``[N, H]`` fp32/bf16/fp16 response-token hidden states.
        weight: ``[V_local, H]`` this rank's vocab shard of the output weight (same dtype).
        label_col: ``[N]`` int64 label column in this shard, ``-1`` off the shard.
        temperature: ``T > 0``; with_entropy: also compute ``a``.
        ops: the elementwise pass (:class:`TorchChunkOps` or the Triton one).
        chunk_size: rows per chunk (None: :func:`auto_chunk_rows`).

    Returns:
        :class:`OnlineStats` with ``[N]`` fp32 fields.
    """
    n, v_local = hidden.size(0), weight.size(0)
    stats = OnlineStats.empty(n, hidden.device, with_entropy)
    if n == 0:
        return stats
    rows = _chunk_rows(n, v_local, hidden, ops, chunk_size)
    buf = torch.empty(min(rows, n), v_local, dtype=hidden.dtype, device=hidden.device)
    w_t = weight.t()
    for r0, r1 in row_ranges(n, rows):
        z = torch.mm(hidden[r0:r1], w_t, out=buf[:r1 - r0])
        ops.stats(z, label_col[r0:r1], temperature, stats.rows(r0, r1))
    return stats


def backward_grads(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                   lse: torch.Tensor, mu: torch.Tensor | None, grad_logp: torch.Tensor | None,
                   grad_entropy: torch.Tensor | None, temperature: float, ops: ChunkOps, *,
                   need_hidden: bool = True, wgrad_acc: torch.Tensor | None = None,
                   chunk_size: int | None = None) -> torch.Tensor | None:
    """``grad_hidden [N, H]`` of this shard (input dtype, or None); adds to ``wgrad_acc``.

    ``lse``, ``mu`` ``[N]`` fp32 global statistics (scaled units); ``grad_logp``,
    ``grad_entropy`` ``[N]`` fp32 upstream gradients or None. ``wgrad_acc``: fp32 ``[V_local, H]``
    to which ``dlogits^T @ hidden`` is added (``weight.main_grad`` or a zeroed output), or None.
    ``grad_hidden`` is this shard's partial sum over its vocab columns (the caller all-reduces).
    """
    n, v_local = hidden.size(0), weight.size(0)
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
        if need_hidden else None
    if n == 0 or not (need_hidden or wgrad_acc is not None):
        return grad_h
    rows = _chunk_rows(n, v_local, hidden, ops, chunk_size)
    buf = torch.empty(min(rows, n), v_local, dtype=hidden.dtype, device=hidden.device)
    w_t = weight.t()

    def cut(t: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
        return None if t is None else t[r0:r1]

    for r0, r1 in row_ranges(n, rows):
        h = hidden[r0:r1]
        dz = torch.mm(h, w_t, out=buf[:r1 - r0])
        ops.dlogits_(dz, label_col[r0:r1], lse[r0:r1], cut(mu, r0, r1), cut(grad_logp, r0, r1),
                     cut(grad_entropy, r0, r1), temperature)
        if grad_h is not None:
            torch.mm(dz, weight, out=grad_h[r0:r1])
        if wgrad_acc is not None:
            ops.wgrad_(wgrad_acc, dz, h)
    return grad_h
