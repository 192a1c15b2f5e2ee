"""Layout-independent token selection: counter-based random keys and an exact global top-k.

Both run on device with integer tensor ops and never read a value on the host.

* :func:`token_hash32` gives each token a pseudo-random 32-bit key from
  ``(seed, step, global sequence index, position)`` (murmur3 finaliser rounds, 32-bit arithmetic
  emulated in int64 without overflow), so every layout draws the same "random" numbers.
* :func:`select_top_keys` selects exactly the ``k`` largest unique int64 keys (score in the high
  word, reversed global token index in the low word; :data:`INACTIVE` for tokens that cannot be
  selected) given a host bound ``k_max >= k``: one ``topk`` of candidates per rank, one
  ``all_gather`` of them with several DP ranks. ``k`` is a device tensor, so no host sync is
  needed to size anything.
* :func:`global_topk_mask` does the same without a host bound, by radix selection: one
  ``all_reduce`` of a digit histogram per pass, 4 passes of 16-bit digits (512 KiB each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.masking import mask_bits

Tensor = torch.Tensor

_M32 = 0xFFFFFFFF
_IDX_BITS = 31  # global token index must be < 2**31 (a mini-batch of < 2.1e9 padded tokens)


def topk_bound(ratio: float, numel: int) -> int:
    """Host upper bound of ``max(floor(ratio * N), 1)`` for any ``N <= numel`` (same float64
    product as the device count, which is monotone in ``N``)."""
    return max(math.floor(ratio * float(numel)), 1)


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """Murmur3 32-bit finaliser on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def token_hash32(seed: int, step: int | Tensor, seq_idx: Tensor, pos: Tensor) -> Tensor:
    """Pseudo-random int64 in ``[0, 2**32)`` per token: ``seq_idx [B]`` x ``pos [T]`` -> ``[B, T]``.

    Depends only on (seed, step, global sequence index, position), never on the layout. The
    per-sequence and per-position parts are hashed on ``[B]`` and ``[T]``; one finaliser round
    mixes them per token.
    """
    seq_idx = seq_idx.to(torch.int64)
    step_t = torch.as_tensor(step, dtype=torch.int64, device=seq_idx.device)
    h_seq = _fmix32((seq_idx & _M32) ^ (int(seed) & _M32))
    h_seq = _fmix32(h_seq ^ ((seq_idx >> 32) & _M32))
    h_seq = _fmix32(h_seq ^ (step_t & _M32))
    h_pos = _fmix32(_fmix32((pos.to(torch.int64) & _M32) ^ 0x9E3779B9))
    mixed = _fmix32_i32(_to_i32(h_seq).unsqueeze(-1) ^ _to_i32(h_pos).unsqueeze(0))
    return mixed.to(torch.int64) & _M32


def token_hash32_flat(seed: int, step: int | Tensor, seq_idx: Sequence[Tensor],
                      lengths: Sequence[int]) -> Tensor:
    """:func:`token_hash32` of several micro-batches (``seq_idx[i] [B_i]``, ``lengths[i] = T_i``),
    flattened row-major and concatenated: ``[sum B_i T_i]`` int64, the same values. The sequence
    and position parts are hashed once for all micro-batches, the per-token mix once on the flat
    tensor (few kernels whatever the number of micro-batches)."""
    return unsigned_i64(token_hash32_flat_i32(seed, step, seq_idx, lengths))


def _seq_and_position_hashes(seed: int, step: int | Tensor, seq_idx: Sequence[Tensor],
                             lengths: Sequence[int]) -> tuple[list[Tensor], Tensor, Tensor]:
    """``(int64 rows, int32 per-sequence hash [sum B_i], int32 per-position hash [max T_i])``."""
    rows = [s.to(torch.int64) for s in seq_idx]
    device = rows[0].device
    seq = torch.cat(rows) if len(rows) > 1 else rows[0]
    if device.type == "cpu" and not isinstance(step, Tensor):  # host values: numpy, few calls
        return rows, _seq_hash_host(seq, seed, step), _position_hash(max(lengths), device)
    # the int64 reference rounds (token_hash32) in int32 arithmetic: the same bits
    if isinstance(step, Tensor):
        step32: Tensor | int = _to_i32(step.to(device=device, dtype=torch.int64) & _M32)
    else:
        step32 = _i32(int(step) & _M32)
    h_seq = _fmix32_i32(_to_i32(seq & _M32) ^ _i32(int(seed) & _M32))
    h_seq = _fmix32_i32(_fmix32_i32(h_seq ^ _to_i32((seq >> 32) & _M32)) ^ step32)
    return rows, h_seq, _position_hash(max(lengths), device)


def _seq_hash_host(seq: Tensor, seed: int, step: int) -> Tensor:
    """The per-sequence part of :func:`token_hash32` (int32 bits ``[n]``) of CPU ``seq`` int64,
    in numpy uint32 arithmetic (wrap-around multiplication is the murmur3 one): the same bits as
    the tensor rounds, in a dozen array operations instead of a few dozen tensor ones."""
    import numpy as np

    def fmix(h):
        _fmix32_numpy_(h, np.empty_like(h))
        return h

    v = seq.numpy().astype(np.uint64)
    lo = (v & np.uint64(_M32)).astype(np.uint32)
    hi = (v >> np.uint64(32)).astype(np.uint32)
    h = fmix(fmix(fmix(lo ^ np.uint32(int(seed) & _M32)) ^ hi) ^ np.uint32(int(step) & _M32))
    return torch.from_numpy(h.view(np.int32).copy())


def token_hash32_flat_i32(seed: int, step: int | Tensor, seq_idx: Sequence[Tensor],
                          lengths: Sequence[int]) -> Tensor:
    """:func:`token_hash32_flat` as int32 bit patterns (read them with :func:`unsigned_i64`)."""
    rows, h_seq, h_pos = _seq_and_position_hashes(seed, step, seq_idx, lengths)
    if all(t == lengths[0] for t in lengths):  # one broadcast for all micro-batches
        mixed = (h_seq.unsqueeze(-1) ^ h_pos.unsqueeze(0)).reshape(-1)
    else:
        parts, start = [], 0
        for r, t in zip(rows, lengths, strict=True):
            parts.append((h_seq[start:start + r.numel()].unsqueeze(-1) ^ h_pos[:t].unsqueeze(0))
                         .reshape(-1))
            start += r.numel()
        mixed = torch.cat(parts)
    return _fmix32_i32(mixed)


_POS_HASH: dict[str, Tensor] = {}


def _position_hash(t: int, device: torch.device) -> Tensor:
    """int32 ``[t]``: the per-position part of :func:`token_hash32` (it depends on nothing else,
    so the longest one per device is kept and sliced)."""
    have = _POS_HASH.get(str(device))
    if have is None or have.numel() < t:
        pos = torch.arange(t, dtype=torch.int64, device=device)
        have = _to_i32(_fmix32(_fmix32((pos & _M32) ^ 0x9E3779B9)))
        _POS_HASH[str(device)] = have
    return have[:t]


def token_hash_parts(seed: int, step: int | Tensor, seq_idx: Sequence[Tensor],
                     lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``(int32 per-sequence hash [sum B_i], int32 per-position hash [max T_i])`` of
    :func:`token_hash32` for several micro-batches: :func:`_fmix32_i32` of ``h_seq[b] ^ h_pos[t]``
    is token ``(b, t)``'s key."""
    _, h_seq, h_pos = _seq_and_position_hashes(seed, step, seq_idx, lengths)
    return h_seq, h_pos


def _to_i32(x: Tensor) -> Tensor:
    """int64 holding 32-bit values -> int32 with the same bits."""
    return ((x ^ 0x80000000) - 0x80000000).to(torch.int32)


def _i32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def _fmix32_i32(h: Tensor) -> Tensor:
    """:func:`_fmix32` on int32 tensors: two's-complement wrap-around of the int32 product is
    the multiplication mod 2**32, logical shifts are arithmetic shifts masked to the low bits
    (the per-token step, 8x fewer bytes and no 64-bit emulation; tested bit-equal to the int64
    reference)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _i32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _i32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def unsigned_i64(x: Tensor) -> Tensor:
    """int32 tensor read as unsigned 32-bit -> int64 in ``[0, 2**32)`` (on CPU one conversion
    through a ``uint32`` view; elsewhere sign extension and a mask, ops every backend has)."""
    if x.device.type == "cpu":
        return x.contiguous().view(torch.uint32).to(torch.int64)
    return x.to(torch.int64) & _M32


def float_order_key(x: Tensor) -> Tensor:
    """int64 in ``[0, 2**32)`` whose order equals the order of the fp32 values ``x`` (no NaN)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip all but the sign bit
    return ordered.to(torch.int64) + 2**31


def composite_key(score_key: Tensor, global_index: Tensor) -> Tensor:
    """Unique non-negative int64 key: ``score_key`` (32 bits) first, then the smaller global
    index wins ties. ``global_index`` must be in ``[0, 2**31)``."""
    return (score_key << _IDX_BITS) | ((2**_IDX_BITS - 1) - global_index)


def global_token_index(ctx: ReductionContext, shapes: Sequence[torch.Size], device: torch.device,
                       first: int = 0) -> list[Tensor]:
    """Per micro-batch ``[B_m, T_m]`` int64 global token index ``seq_idx * max_len + t``
    (``shapes`` of the local micro-batches ``first``, ``first + 1``, ...)."""
    out = []
    for i, shape in enumerate(shapes, start=first):
        seq = ctx.seq_index(i, shape[0], device).unsqueeze(-1)
        pos = torch.arange(shape[1], device=device).unsqueeze(0)
        out.append(seq * ctx.max_len.to(device) + pos)
    return out


def global_topk_mask(keys: Tensor, active: Tensor, k: Tensor, ctx: ReductionContext,
                     digit_bits: int = 16, k_max: int | None = None) -> Tensor:
    """Select the ``min(k, #active globally)`` largest ``keys`` among ``active`` tokens (all ranks).

    ``keys``: 1-D int64, non-negative and globally unique; ``active``: 1-D bool; ``k``: 0-dim int64.
    Returns a 1-D bool mask of this rank's selected tokens. Exact radix selection of the k-th
    largest key, most significant digit first: one ``all_reduce`` of a ``2**digit_bits``-bin
    histogram per digit (4 passes with the default 16-bit digits). With one DP rank and a host
    bound ``k_max >= k``: :func:`local_topk_mask` (identical selection, no collective).
    """
    if k_max is not None and (ctx.group is None or ctx.dp_size == 1):
        return local_topk_mask(keys, active, k, k_max)
    device = keys.device
    bins = 1 << digit_bits
    ones = torch.ones_like(keys)
    prefix = torch.zeros((), dtype=torch.int64, device=device)
    match = active
    need = k_eff = None
    for shift in range(64 - digit_bits, -1, -digit_bits):
        digit = (keys >> shift) & (bins - 1)
        slot = torch.where(match, digit, bins)
        hist = torch.zeros(bins + 1, dtype=torch.int64, device=device).index_add_(0, slot, ones)
        hist = hist[:bins]
        ctx.all_reduce(hist)
        if need is None:
            k_eff = torch.minimum(k.to(torch.int64), hist.sum())
            need = k_eff.clamp_min(1)
        at_or_above = hist.flip(0).cumsum(0).flip(0)  # [d] -> count with digit >= d
        d = ((at_or_above >= need).sum() - 1).clamp(0, bins - 1)
        above = at_or_above.gather(0, d.view(1)).squeeze(0) - hist.gather(0, d.view(1)).squeeze(0)
        need = need - above
        prefix = prefix | (d << shift)
        match = match & (digit == d)
    return active & (keys >= prefix) & (k_eff > 0)


def local_topk_mask(keys: Tensor, active: Tensor, k: Tensor, k_max: int) -> Tensor:
    """Single-process :func:`global_topk_mask`: the ``min(k, #active)`` largest unique ``keys``
    among ``active``, given a host bound ``k_max >= k``. One ``topk`` of ``min(k_max, N)`` keys
    (inactive ones masked to -1), then the ``k``-th largest is read by a device gather: no sync."""
    n = keys.numel()
    if n == 0:
        return active.clone()
    masked = keys | ~mask_bits(active, torch.int64)  # inactive -> -1, below every real key
    top = torch.topk(masked, min(int(k_max), n), sorted=True).values
    k_eff = torch.minimum(k.to(torch.int64), active.sum())
    thr = top.gather(0, (k_eff - 1).clamp(0, top.numel() - 1).view(1)).squeeze(0)
    return active & (keys >= thr) & (k_eff > 0)


_REV_INDEX: dict[str, Tensor] = {}


def reversed_index32(n: int, device: torch.device, start: int = 0) -> Tensor:
    """int32 ``2**31 - 1 - arange(start, start + n)`` (flat positions as reversed indices, the
    low word of the selection's int64 keys: the smaller index wins ties; positions must stay below
    ``2**31 - 1`` so that every value is >= 1). The longest one per device is kept and sliced."""
    if start + n > 2**31 - 1:
        raise ValueError(f"token index up to {start + n} must stay below 2**31 - 1")
    have = _REV_INDEX.get(str(device))
    if have is None or have.numel() < start + n:
        top = 2**_IDX_BITS - 1
        have = torch.arange(top, top - (start + n), -1, dtype=torch.int32, device=device)
        _REV_INDEX[str(device)] = have
    return have[start:start + n]


def _xorshift16(h: Tensor) -> Tensor:
    """``h ^ (h >>> 16)`` on int32 (the finaliser's first step, new tensor)."""
    return h ^ ((h >> 16) & 0xFFFF)


def fmix32_i32_(h: Tensor, tmp: Tensor, premixed: bool = False) -> Tensor:
    """:func:`_fmix32_i32` in place on int32 ``h`` (``tmp``: an int32 buffer of ``h``'s shape,
    overwritten): the same bits, no new tensors. ``premixed``: ``h`` already went through the
    first step ``h ^ (h >>> 16)``; that step is linear over XOR, so for ``h = a ^ b`` it can be
    taken on ``a`` and ``b`` apart (see :func:`token_hash_parts_premixed`)."""
    if h.device.type == "cpu" and h.is_contiguous() and tmp.is_contiguous():
        import numpy as np

        _fmix32_numpy_(h.numpy().view(np.uint32), tmp.numpy().view(np.uint32),  # device-spy: ok
                       premixed)  # (CPU tensors only)
        return h
    for j, (shift, mask, mul) in enumerate(_FMIX_STEPS):
        if not (premixed and j == 0):
            torch.bitwise_right_shift(h, shift, out=tmp)
            h.bitwise_xor_(tmp.bitwise_and_(mask))
        if mul is not None:
            h.mul_(_i32(mul))
    return h


_FMIX_STEPS = ((16, 0xFFFF, 0x85EBCA6B), (13, 0x7FFFF, 0xC2B2AE35), (16, 0xFFFF, None))


def _fmix32_numpy_(hv, tv, premixed: bool = False) -> None:
    """The murmur3 finaliser in place on a numpy ``uint32`` array ``hv`` (``tv``: a scratch
    array of its shape): numpy's shifts are logical and its products wrap, so no masking step is
    needed (the same bits as the int32 tensor rounds, fewer passes over the data)."""
    import numpy as np

    for j, (shift, _, mul) in enumerate(_FMIX_STEPS):
        if not (premixed and j == 0):
            np.right_shift(hv, np.uint32(shift), out=tv)
            np.bitwise_xor(hv, tv, out=hv)
        if mul is not None:
            np.multiply(hv, np.uint32(mul), out=hv)


def token_hash_parts_premixed(seed: int, step: int | Tensor, seq_idx: Sequence[Tensor],
                              lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """:func:`token_hash_parts` after the finaliser's first step ``x ^ (x >>> 16)``, which is
    linear over XOR: ``fmix32_i32_(s[b] ^ p[t], tmp, premixed=True)`` of these parts ``(s, p)``
    is the token's :func:`token_hash32` (int32 bits), one step fewer per token."""
    h_seq, h_pos = token_hash_parts(seed, step, seq_idx, lengths)
    have = _POS_PREMIXED.get(str(h_pos.device))
    if have is None or have.numel() < h_pos.numel():  # it depends on the position only
        have = _xorshift16(_position_hash(h_pos.numel(), h_pos.device))
        _POS_PREMIXED[str(h_pos.device)] = have
    return _xorshift16(h_seq), have[:h_pos.numel()]


_POS_PREMIXED: dict[str, Tensor] = {}


@dataclass
class TopK:
    """Result of :func:`select_top_keys`: this rank's selected tokens and global totals."""

    selected: Tensor  # [N] bool, this rank's tokens among the global top k
    count: Tensor  # int64 0-dim: number selected over all ranks, min(k, #active)
    active: Tensor  # int64 0-dim: active tokens over all ranks
    value_sum: Tensor  # fp64 0-dim: sum of ``values`` over the selected tokens of all ranks


INACTIVE = -(2**63)  # the key of a token that cannot be selected: below every active key


def select_top_keys(keys: Tensor, values: Tensor, active_count: Tensor, k: Tensor, k_max: int,
                    ctx: ReductionContext) -> TopK:
    """Exact global top-``min(k, #active)`` of unique int64 ``keys`` ([N]; :data:`INACTIVE` for
    the tokens that cannot be selected, every other key unique over all ranks), given a host
    bound ``k_max >= k``.

    ``values`` ([N] fp32) are summed over the selection (a metric); ``active_count`` is this
    rank's number of active tokens (int64 0-dim). One ``topk`` of ``min(k_max, N)`` keys per
    rank; with several DP ranks each sends its ``k_max`` best keys, their values and its active
    count in **one** ``all_gather`` (every token of the global top k is among its rank's top
    ``k_max``), and every rank picks the global top k from the gathered candidates. No host sync.
    """
    n, device = keys.numel(), keys.device
    kk = min(int(k_max), n)
    if kk > 0:
        top_v, top_i = torch.topk(keys, kk, sorted=True)
    else:
        top_v = torch.empty(0, dtype=torch.int64, device=device)
        top_i = torch.empty(0, dtype=torch.int64, device=device)
    top_val = values.gather(0, top_i).to(torch.float64)
    k = k.to(torch.int64)
    if ctx.group is None or ctx.dp_size == 1:
        count = torch.minimum(k, active_count.to(torch.int64))
        flags = (torch.arange(kk, device=device) < count) & (top_v != INACTIVE)
        total_active = active_count.to(torch.int64)
        value_sum = torch.where(flags, top_val, 0.0).sum()
    else:
        import torch.distributed as dist

        cand = torch.full((2 * k_max + 1,), INACTIVE, dtype=torch.int64, device=device)
        cand[:kk] = top_v
        cand[k_max:k_max + kk] = top_val.view(torch.int64)
        cand[2 * k_max] = active_count
        rows = [torch.empty_like(cand) for _ in range(ctx.dp_size)]
        dist.all_gather(rows, cand, group=ctx.group)  # the one collective of the selection
        g = torch.stack(rows)
        g_keys = g[:, :k_max].reshape(-1)
        g_vals = g[:, k_max:2 * k_max].reshape(-1).view(torch.float64)
        total_active = g[:, 2 * k_max].sum()
        count = torch.minimum(k, total_active)
        best_v, best_i = torch.topk(g_keys, min(k_max, g_keys.numel()), sorted=True)
        g_flags = (torch.arange(best_v.numel(), device=device) < count) & (best_v != INACTIVE)
        thr = best_v.gather(0, (count - 1).clamp(0, best_v.numel() - 1).view(1)).squeeze(0)
        flags = (top_v >= thr) & (top_v != INACTIVE) & (count > 0)
        value_sum = torch.where(g_flags, g_vals.gather(0, best_i), 0.0).sum()
    selected = torch.zeros(n, dtype=torch.bool, device=device).scatter_(0, top_i, flags)
    return TopK(selected, count, total_active, value_sum)


def top_candidates(keys: Tensor, values: Tensor, k_max: int) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's ``min(k_max, n)`` largest keys (1-D int64, unsorted), their positions in the
    chunk and their ``values`` (1-D fp32): the chunk's candidates for the global top k."""
    kk = min(int(k_max), keys.numel())
    if kk > 0:
        tv, ti = torch.topk(keys, kk, sorted=False)
    else:
        tv = torch.empty(0, dtype=torch.int64, device=keys.device)
        ti = torch.empty(0, dtype=torch.int64, device=keys.device)
    return tv, ti, values.reshape(-1).gather(0, ti)


def select_from_candidates(cands: Sequence[tuple[Tensor, Tensor, Tensor]], sizes: Sequence[int],
                           active_count: Tensor, k: Tensor, k_max: int, ctx: ReductionContext
                           ) -> tuple[list[Tensor], TopK]:
    """:func:`select_top_keys` over the :func:`top_candidates` of several chunks (``sizes[i]``
    tokens each; the global top k is among them). Returns each chunk's 1-D selected mask and the
    totals (``TopK.selected`` is over the candidates)."""
    device = cands[0][0].device
    res = select_top_keys(torch.cat([c[0] for c in cands]), torch.cat([c[2] for c in cands]),
                          active_count, k, k_max, ctx)
    out, start = [], 0
    for (_, ti, _), n in zip(cands, sizes, strict=True):
        out.append(torch.zeros(n, dtype=torch.bool, device=device)
                   .scatter_(0, ti, res.selected[start:start + ti.numel()]))
        start += ti.numel()
    return out, res


def select_top_keys_chunks(keys: Sequence[Tensor], values: Sequence[Tensor], active_count: Tensor,
                           k: Tensor, k_max: int, ctx: ReductionContext
                           ) -> tuple[list[Tensor], TopK]:
    """:func:`select_top_keys` over several 1-D chunks (one per micro-batch, each small enough
    to stay in cache): one ``topk`` of ``min(k_max, n_i)`` per chunk, then the selection over
    the concatenated chunk candidates (the global top k is among them). Returns each chunk's
    selected mask and the totals (``TopK.selected`` is over the candidates)."""
    cands = [top_candidates(kc, vc, k_max) for kc, vc in zip(keys, values, strict=True)]
    return select_from_candidates(cands, [kc.numel() for kc in keys], active_count, k, k_max,
                                  ctx)
