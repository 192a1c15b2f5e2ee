"""Triton kernels of the fused linear head + log-prob + entropy (one rank's vocab shard).

Imported lazily (only when the Triton backend is chosen): ``import triton`` at the top of this
module is fine, nothing imports it on a CPU-only path. Same math as the torch reference
(:mod:`kernels.fused_head_torch`); the collectives live in the autograd Function.

Forward kernel, grid ``(cdiv(N, BLOCK_N), vocab_splits)``: each program owns ``BLOCK_N`` rows and
a contiguous run of ``BLOCK_V``-column vocab tiles; per tile it computes the fp32 logits tile
``h[rows] @ w[cols]^T`` in registers (``BLOCK_K`` slices of ``H``) and folds it into the running
``(m, s, a, zlab)`` of its rows. It writes ``[4, vocab_splits, N]`` fp32 partials, merged on the
host by :func:`kernels.fused_head_torch.combine_partials` (the same rescaling as across TP ranks).

Backward kernel, grid ``(cdiv(N, BLOCK_N), cdiv(V_local, BLOCK_V))``: each program recomputes its
logits tile, forms ``dz = (g_lp (onehot - p) - g_H p (z - mu)) / T`` in fp32, rounds it to the
input dtype (the unfused path's logits-gradient dtype; also the tensor-core operand) and
accumulates ``dh[rows] += dz @ w[cols]`` and ``dw[cols] += dz^T @ h[rows]`` into fp32 buffers with
``tl.atomic_add`` (``BLOCK_K`` slices of ``H`` at a time). fp32 atomics make the summation order,
and so the last bits of the gradients, run-to-run nondeterministic (~1e-7 relative).

Interpreter note (``TRITON_INTERPRET=1``, CPU): Triton 3.x's interpreter computes ``tl.dot`` of
bf16 operands on their raw uint16 storage (wrong numbers), so under the interpreter the operands
are upcast to fp32 before ``tl.dot`` (``DOT_FP32``); products of bf16/fp16 values are exact in
fp32, so the result is the same as a bf16 tensor-core dot with fp32 accumulation. fp32 inputs use
``input_precision="ieee"`` (no TF32), so fp32 results match the torch reference to ~1e-6.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused_head_torch import OnlineStats, combine_partials

__all__ = ["TritonTiles", "interpreter_active", "triton_backward_grads", "triton_forward_stats"]

_FP32 = torch.float32


@dataclass(frozen=True)
class TritonTiles:
    """Tile shape and launch settings (untuned defaults for H100-class GPUs).

    ``vocab_splits`` None: enough splits for ~4 programs per SM in the forward.
    """

    block_n: int = 64
    block_v: int = 128
    block_k: int = 64
    vocab_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 3


def interpreter_active() -> bool:
    """True when Triton runs in interpreter mode (CPU tensors, numpy execution)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_V]`` raw logits ``h[rows] @ w[cols]^T`` (K loop over ``H``)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hn + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wv + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)
    return acc


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, lab_ptr, part_ptr, N, V, H, stride_hn, stride_wv, temperature,
                num_tiles, tiles_per_split, n_splits,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                WITH_ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    label = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    a = tl.zeros([BLOCK_N], dtype=tl.float32)
    zlab = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_start = pid_s * tiles_per_split
    t_stop = tl.minimum(t_start + tiles_per_split, num_tiles)
    for t in range(t_start, t_stop):
        cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                         BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, IEEE) / temperature
        z = tl.where(col_ok[None, :], z, float("-inf"))
        zlab += tl.sum(tl.where(cols[None, :] == label[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        delta = m - m_new
        scale = tl.exp(delta)
        shifted = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(shifted), 0.0)
        if WITH_ENTROPY:
            a = scale * (a + tl.where(s > 0, delta, 0.0) * s) + tl.sum(e * shifted, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new
    stride_stat = n_splits * N
    out = part_ptr + pid_s * N + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride_stat, s, mask=row_ok)
    tl.store(out + 2 * stride_stat, a, mask=row_ok)
    tl.store(out + 3 * stride_stat, zlab, mask=row_ok)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, lab_ptr, lse_ptr, mu_ptr, glp_ptr, gh_ptr, dh_ptr, dw_ptr,
                N, V, H, stride_hn, stride_wv, temperature,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_GLP: tl.constexpr, HAS_GH: tl.constexpr, NEED_DH: tl.constexpr,
                NEED_DW: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    valid = row_ok[:, None] & col_ok[None, :]
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_hn, stride_wv,
                     BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, IEEE) / temperature
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(valid, tl.exp(z - lse[:, None]), 0.0)
    dz = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_GH:
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        g_h = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        dz -= p * (z - mu[:, None]) * g_h[:, None]
    if HAS_GLP:
        label = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
        g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        onehot = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
        dz += (onehot - p) * g_lp[:, None]
    dz = tl.where(valid, dz / temperature, 0.0)
    dz = dz.to(h_ptr.dtype.element_ty)           # the unfused path's dlogits dtype
    if DOT_FP32:
        dz = dz.to(tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        if NEED_DH:
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wv + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:
                w = w.to(tl.float32)
            if IEEE:
                dh = tl.dot(dz, w, input_precision="ieee")
            else:
                dh = tl.dot(dz, w)
            tl.atomic_add(dh_ptr + rows[:, None].to(tl.int64) * H + ks[None, :], dh,
                          mask=row_ok[:, None] & k_ok[None, :])
        if NEED_DW:
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hn + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:
                h = h.to(tl.float32)
            if IEEE:
                dw = tl.dot(tl.trans(dz), h, input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(dz), h)
            tl.atomic_add(dw_ptr + cols[:, None].to(tl.int64) * H + ks[None, :], dw,
                          mask=col_ok[:, None] & k_ok[None, :])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _dot_flags(hidden: torch.Tensor) -> tuple[bool, bool]:
    """``(DOT_FP32, IEEE)``: upcast under the interpreter; exact fp32 dot for fp32 inputs."""
    interp = interpreter_active()
    return interp or hidden.dtype == _FP32, interp or hidden.dtype == _FP32


def _vocab_splits(tiles: TritonTiles, n_row_blocks: int, num_tiles: int,
                  device: torch.device) -> int:
    if tiles.vocab_splits is not None:
        return max(1, min(tiles.vocab_splits, num_tiles))
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 4
    return max(1, min(num_tiles, triton.cdiv(4 * sms, n_row_blocks)))


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("hidden and weight must have unit stride along H")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")


def triton_forward_stats(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                         temperature: float, with_entropy: bool,
                         tiles: TritonTiles | None = None) -> OnlineStats:
    """Local statistics of this shard (see :func:`kernels.fused_head_torch.forward_stats`).

    ``hidden [N, H]``, ``weight [V_local, H]`` (same dtype, unit stride along H),
    ``label_col [N]`` int64 (-1 off shard). Returns ``[N]`` fp32 statistics.
    """
    tiles = tiles or TritonTiles()
    _check_inputs(hidden, weight)
    n, h_dim = hidden.shape
    v_local = weight.size(0)
    num_tiles = triton.cdiv(v_local, tiles.block_v)
    n_row_blocks = triton.cdiv(n, tiles.block_n)
    splits = _vocab_splits(tiles, n_row_blocks, num_tiles, hidden.device)
    tiles_per_split = triton.cdiv(num_tiles, splits)
    splits = triton.cdiv(num_tiles, tiles_per_split)     # no empty split
    part = torch.empty(4, splits, n, dtype=_FP32, device=hidden.device)
    dot_fp32, ieee = _dot_flags(hidden)
    if n > 0:
        _fwd_kernel[(n_row_blocks, splits)](
            hidden, weight, label_col, part, n, v_local, h_dim, hidden.stride(0),
            weight.stride(0), float(temperature), num_tiles, tiles_per_split, splits,
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k,
            WITH_ENTROPY=with_entropy, DOT_FP32=dot_fp32, IEEE=ieee,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return combine_partials(part[0], part[1], part[2] if with_entropy else None, part[3])


def triton_backward_grads(hidden: torch.Tensor, weight: torch.Tensor, label_col: torch.Tensor,
                          lse: torch.Tensor, mu: torch.Tensor | None,
                          grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                          temperature: float, *, need_hidden: bool = True,
                          need_weight: bool = True, tiles: TritonTiles | None = None,
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 ``(grad_hidden [N, H], grad_weight [V_local, H])`` of this shard (None if unneeded).

    Same contract as :func:`kernels.fused_head_torch.backward_grads`.
    """
    tiles = tiles or TritonTiles()
    _check_inputs(hidden, weight)
    n, h_dim = hidden.shape
    v_local = weight.size(0)
    dh = torch.zeros(n, h_dim, dtype=_FP32, device=hidden.device) if need_hidden else None
    dw = torch.zeros(v_local, h_dim, dtype=_FP32, device=hidden.device) if need_weight else None
    dummy = lse  # stands in for absent optional pointers (never read: constexpr-guarded)
    dot_fp32, ieee = _dot_flags(hidden)
    if n > 0 and (need_hidden or need_weight):
        grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(v_local, tiles.block_v))
        _bwd_kernel[grid](
            hidden, weight, label_col, lse, dummy if mu is None else mu,
            dummy if grad_logp is None else grad_logp,
            dummy if grad_entropy is None else grad_entropy,
            dummy if dh is None else dh, dummy if dw is None else dw,
            n, v_local, h_dim, hidden.stride(0), weight.stride(0), float(temperature),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k,
            HAS_GLP=grad_logp is not None, HAS_GH=grad_entropy is not None,
            NEED_DH=need_hidden, NEED_DW=need_weight, DOT_FP32=dot_fp32, IEEE=ieee,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return dh, dw
