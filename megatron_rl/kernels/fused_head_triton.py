"""Triton elementwise passes of the row-chunked fused head (one rank's vocab shard).

Imported lazily (only when the Triton backend is chosen). The GEMMs are cuBLAS (``torch.mm`` in
the input dtype, driven by :mod:`megatron_rl.kernels.fused_head_torch`); Triton does the passes
between them, each reading the ``[c, V_local]`` chunk logits once:

* :func:`_stats_kernel`, grid ``cdiv(c, BLOCK_R)``: each program owns ``BLOCK_R`` whole rows and
  walks the vocab in ``BLOCK_V`` tiles with an online softmax, writing ``m, s, a, zlab`` (fp32).
* :func:`_dlogits_kernel`, grid ``(cdiv(c, BLOCK_R), cdiv(V_local, BLOCK_V))``: elementwise,
  overwrites the chunk logits in place with ``dz = (g_lp (onehot - p) - g_H p (z/T - mu)) / T``
  (fp32 math, stored in the input dtype).
* :func:`_wgrad_kernel`, grid ``(cdiv(V_local, BLOCK_M), cdiv(H, BLOCK_N))``: ``acc += dz^T @ h``
  into an fp32 ``[V_local, H]`` accumulator, each program owning one output tile (no atomics,
  fixed K order: deterministic). Used where cuBLAS cannot accumulate bf16 x bf16 into fp32
  (``torch.addmm(..., out_dtype=torch.float32)`` is tried first on CUDA; see :class:`TritonTiles`).

Interpreter note (``TRITON_INTERPRET=1``, CPU): Triton's interpreter computes ``tl.dot`` of bf16
operands wrongly, so there the operands are upcast to fp32 first (``DOT_FP32``); products of
bf16/fp16 values are exact in fp32, so the result equals a tensor-core dot with fp32 accumulation.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_rl.kernels.fused_head_torch import OnlineStats

__all__ = ["TritonChunkOps", "TritonTiles", "interpreter_active"]

_FP32 = torch.float32
WGRAD_MODES = ("auto", "cublas", "triton")


@dataclass(frozen=True)
class TritonTiles:
    """Tile shapes (untuned defaults for H100-class GPUs) and the ``grad_weight`` GEMM choice.

    ``wgrad``: ``"auto"`` (cuBLAS ``addmm(out_dtype=fp32)`` when it works on this device, else
    the Triton GEMM), ``"cublas"`` or ``"triton"``. fp32 inputs always use ``addmm_``.
    """

    block_r: int = 2
    block_v: int = 2048
    num_warps: int = 8
    mm_block_m: int = 128
    mm_block_n: int = 128
    mm_block_k: int = 64
    mm_num_warps: int = 8
    mm_num_stages: int = 3
    wgrad: str = "auto"

    def __post_init__(self) -> None:
        if self.wgrad not in WGRAD_MODES:
            raise ValueError(f"TritonTiles.wgrad must be one of {WGRAD_MODES}, got {self.wgrad!r}")


def interpreter_active() -> bool:
    """True when Triton runs in interpreter mode (CPU tensors, numpy execution)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _stats_kernel(z_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zlab_ptr, n_rows, V, stride_z,
                  temperature, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                  WITH_ENTROPY: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    label = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
    base = z_ptr + rows[:, None].to(tl.int64) * stride_z
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    a = tl.zeros([BLOCK_R], dtype=tl.float32)
    zlab = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < V)[None, :]
        z = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32) / temperature
        z = tl.where(ok, z, float("-inf"))
        zlab += tl.sum(tl.where(cols[None, :] == label[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows past n_rows
        delta = m - m_safe
        scale = tl.exp(delta)
        shifted = tl.where(ok, z - m_safe[:, None], 0.0)
        e = tl.where(ok, tl.exp(shifted), 0.0)
        if WITH_ENTROPY:
            a = scale * (a + tl.where(s > 0, delta, 0.0) * s) + tl.sum(e * shifted, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new
    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(s_ptr + rows, s, mask=row_ok)
    tl.store(zlab_ptr + rows, zlab, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(a_ptr + rows, a, mask=row_ok)


@triton.jit
def _dlogits_kernel(z_ptr, lab_ptr, lse_ptr, mu_ptr, glp_ptr, gh_ptr, n_rows, V, stride_z,
                    temperature, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                    HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < V)[None, :]
    ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :]
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) / temperature
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    dz = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    if HAS_GH:
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        g_h = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        dz -= p * (z - mu[:, None]) * g_h[:, None]
    if HAS_GLP:
        label = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
        g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        onehot = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
        dz += (onehot - p) * g_lp[:, None]
    dz = dz / temperature
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _wgrad_kernel(dz_ptr, h_ptr, acc_ptr, K, M, N, stride_dz, stride_h, stride_acc,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """``acc[M, N] += dz[K, M]^T @ h[K, N]`` (fp32 accumulator, one output tile per program)."""
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(dz_ptr + ks[:, None].to(tl.int64) * stride_dz + ms[None, :],
                    mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(h_ptr + ks[:, None].to(tl.int64) * stride_h + ns[None, :],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            tile = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), tile,
                          input_precision="ieee")
        else:
            tile = tl.dot(tl.trans(a), b, tile)
    out = acc_ptr + ms[:, None].to(tl.int64) * stride_acc + ns[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(out, tl.load(out, mask=ok, other=0.0) + tile, mask=ok)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
@functools.cache
def _cublas_fp32_accumulate_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=fp32, out=acc)`` works (and is right) on
    ``device``; probed once per device and dtype, with every tensor made there."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 48, generator=g, device=device).to(dtype)
    b = torch.randn(64, 40, generator=g, device=device).to(dtype)
    acc = torch.randn(48, 40, generator=g, device=device)
    want = acc + a.float().t() @ b.float()
    try:
        torch.addmm(acc, a.t(), b, out_dtype=_FP32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-3))  # once per device and dtype


class TritonChunkOps:
    """The elementwise passes as Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    extra_fp32_buffers = 0

    def __init__(self, tiles: TritonTiles | None = None):
        self.tiles = tiles or TritonTiles()

    def stats(self, z, label_col, temperature, out: OnlineStats) -> None:
        t = self.tiles
        n_rows, v = z.shape
        a = out.a if out.a is not None else out.s      # never written without the entropy
        _stats_kernel[(triton.cdiv(n_rows, t.block_r),)](
            z, label_col, out.m, out.s, a, out.zlab, n_rows, v, z.stride(0), float(temperature),
            BLOCK_R=t.block_r, BLOCK_V=t.block_v, WITH_ENTROPY=out.a is not None,
            num_warps=t.num_warps)

    def dlogits_(self, z, label_col, lse, mu, grad_logp, grad_entropy, temperature) -> None:
        t = self.tiles
        n_rows, v = z.shape
        block_v = min(t.block_v, 1024)
        _dlogits_kernel[(triton.cdiv(n_rows, t.block_r), triton.cdiv(v, block_v))](
            z, label_col, lse, lse if mu is None else mu,
            lse if grad_logp is None else grad_logp, lse if grad_entropy is None else grad_entropy,
            n_rows, v, z.stride(0), float(temperature), BLOCK_R=t.block_r, BLOCK_V=block_v,
            HAS_GLP=grad_logp is not None, HAS_GH=grad_entropy is not None,
            num_warps=t.num_warps)

    def wgrad_(self, acc, dz, h) -> None:
        if dz.dtype == acc.dtype:
            acc.addmm_(dz.t(), h)
            return
        t = self.tiles
        interp = interpreter_active()
        if not interp and t.wgrad != "triton" and acc.is_cuda:
            if t.wgrad == "cublas" or _cublas_fp32_accumulate_ok(acc.device, dz.dtype):
                torch.addmm(acc, dz.t(), h, out_dtype=_FP32, out=acc)
                return
        k, m = dz.shape
        n = h.size(1)
        grid = (triton.cdiv(m, t.mm_block_m), triton.cdiv(n, t.mm_block_n))
        _wgrad_kernel[grid](dz, h, acc, k, m, n, dz.stride(0), h.stride(0), acc.stride(0),
                            BLOCK_M=t.mm_block_m, BLOCK_N=t.mm_block_n, BLOCK_K=t.mm_block_k,
                            DOT_FP32=interp, num_warps=t.mm_num_warps,
                            num_stages=t.mm_num_stages)
