"""Clip-Cov and KL-Cov (§4) with mini-batch-global statistics, plus the §12 diagnostic.

Per mini-batch, before any micro-batch runs backward:

1. pick the log-prob statistic source (:func:`cov_stat_logp`): ``cov_stat_source="prepass"``
   (exact; the caller runs a no-grad forward of the current weights over the mini-batch) or
   ``"old_logp"`` (free; exact for the first update after a rollout, an approximation for later
   mini-batches / epochs because the weights have moved);
2. :func:`select_cov_tokens` computes ``Cov_t = (logp_t - mean logp)(A_t - mean A)`` with means
   over the **global** valid tokens, and selects tokens with an exact global rule (the same tokens
   for any DP / micro-batch split): KL-Cov takes the top ``max(floor(kl_cov_ratio * N), 1)``
   Cov tokens (ties -> smaller global index); Clip-Cov takes
   ``min(max(floor(clip_cov_ratio * N), 1), #candidates)`` candidates uniformly at random,
   the randomness being a hash of (``cov_seed``, step, global token index);
3. each micro-batch passes its slice as ``LossInputs.cov_selected`` to the loss below, whose
   fused forward/backward (:class:`_ClipCovLoss`, :class:`_KLCovLoss`) give autograd's loss
   through the plain expressions bit for bit and its gradient in value (a zero may carry the
   other sign), and return their metric sums (``ratio`` records).

Cost on CPU: the selection concatenates the micro-batches once and runs each step on the flat
tensors (a few dozen kernels per mini-batch instead of a few dozen per micro-batch), in scratch
buffers kept between calls (a fresh tensor of a mini-batch's size costs a page fault per page on
every call).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.loss import masking
from megatron_rl.loss.common import log_ratio, ppo_kl_stat
from megatron_rl.loss.context import ReductionContext, as_list
from megatron_rl.loss.masking import (
    _INT_OF,
    adjacent_view,
    compare,
    count_true,
    counts_f64,
    mask_bits,
    masked_zero,
    mul_mask_,
    zero_where_not,
)
from megatron_rl.loss.metrics import mean_stat, ratio_stat
from megatron_rl.loss.params import LossConfigError, LossParams
from megatron_rl.loss.select import (
    INACTIVE,
    TopK,
    fmix32_i32_,
    global_token_index,
    global_topk_mask,
    reversed_index32,
    select_top_keys,
    token_hash_parts_premixed,
    topk_bound,
)
from megatron_rl.loss.types import LossInputs, TokenLoss

Tensor = torch.Tensor
TensorList = Tensor | Sequence[Tensor]


@dataclass
class CovSelection:
    """Selected-token masks (one ``[B_m, T_m]`` bool per local micro-batch) and global metrics."""

    selected: list[Tensor]
    stats: dict[str, Tensor]


def cov_stat_logp(cfg: LossParams, old_logp: TensorList, prepass_logp: TensorList | None = None
                  ) -> list[Tensor]:
    """The log-probs the covariance statistic is computed from (see module docstring)."""
    if cfg.cov_stat_source == "old_logp":
        return [x.detach() for x in as_list(old_logp)]
    if cfg.cov_stat_source == "prepass":
        if prepass_logp is None:
            raise LossConfigError("cov_stat_source='prepass' needs the no-grad pre-pass log-probs "
                                  "of the current weights (prepass_logp); or set "
                                  "cov_stat_source='old_logp' (exact only for the first update)")
        return [x.detach() for x in as_list(prepass_logp)]
    raise LossConfigError(f"cov_stat_source={cfg.cov_stat_source!r}; allowed: "
                          "['prepass', 'old_logp']")


def token_covariance(ctx: ReductionContext, logp: TensorList, advantages: TensorList,
                     masks: TensorList) -> tuple[list[Tensor], Tensor]:
    """Per-token ``Cov_t`` (fp32 ``[B_m, T_m]``, 0 at padding) with global fp64 means, and the
    global batch covariance ``mean_t Cov_t`` (0-dim fp64). One ``all_reduce`` of 3 numbers."""
    ms = [m.bool() for m in as_list(masks)]
    with torch.no_grad():
        return _covariances(ctx, as_list(logp), as_list(advantages), ms)


def _covariances(ctx: ReductionContext, logp: list[Tensor], adv: list[Tensor],
                 valid: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """:func:`token_covariance`: :func:`_cov_means`, then each micro-batch's
    :func:`_token_cov` with padding zeroed."""
    mean_lp, mean_a, batch_cov = _cov_means(ctx, logp, adv, valid)
    cov = [zero_where_not(_token_cov(x, a, mean_lp, mean_a), mask_bits(v, torch.float32))
           for x, a, v in zip(logp, adv, valid, strict=True)]
    return cov, batch_cov


def _cov_means(ctx: ReductionContext, logp: list[Tensor], adv: list[Tensor],
               valid: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Global means of ``logp`` and ``A`` over the valid tokens, rounded to fp32 (0-dim), and the
    batch covariance ``mean(logp A) - mean(logp) mean(A)`` (0-dim fp64). Sums in fp64 micro-batch
    by micro-batch (padding zeroed by bit masking; each micro-batch's temporaries are freed
    before the next one's, so their memory is reused), then one ``all_reduce`` of 3 numbers."""
    parts = []
    for lp, a, v in zip(logp, adv, valid, strict=True):
        bits: dict[torch.dtype, Tensor] = {}  # one mask word per dtype, shared
        x, y = _zero_padding(lp, v, bits).double(), _zero_padding(a, v, bits).double()
        parts.append(torch.stack([x.sum(), y.sum(), (x * y).sum()]))
        del x, y, bits
    sums = torch.stack(parts).sum(0)
    ctx.all_reduce(sums)
    n = ctx.num_tokens.clamp_min(1).double()
    mean_lp, mean_a = sums[0] / n, sums[1] / n
    batch_cov = sums[2] / n - mean_lp * mean_a
    return mean_lp.float(), mean_a.float(), batch_cov


def _token_cov(logp: Tensor, adv: Tensor, mean_lp: Tensor, mean_a: Tensor) -> Tensor:
    """fp32 ``Cov_t = (logp - mean_lp) (A - mean_a)`` ``[B, T]`` in fp32 arithmetic (the means
    from :func:`_cov_means`; any value at padding). Each token's value depends only on its own
    inputs and the global means, so it is the same in every layout."""
    return (logp.float() - mean_lp) * (adv.float() - mean_a)


def _zero_padding(x: Tensor, valid: Tensor, bits: dict[torch.dtype, Tensor]) -> Tensor:
    """``x`` with padding set to +0 (bit masking in ``x``'s dtype, the mask words kept in
    ``bits`` per dtype; ``where`` for other dtypes)."""
    if x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        if x.dtype not in bits:
            bits[x.dtype] = mask_bits(valid, x.dtype)
        return zero_where_not(x, bits[x.dtype])
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _flat(xs: list[Tensor]) -> Tensor:
    return torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1)


def _unflat(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for x in like:
        out.append(flat[start:start + x.numel()].view(x.shape))
        start += x.numel()
    return out


def _count_k(ratio: float, n: Tensor) -> Tensor:
    """``max(floor(ratio * N), 1)`` as int64 device tensor."""
    return torch.floor(ratio * n.double()).to(torch.int64).clamp_min(1)


def ppo_clipped(ratio: Tensor, advantages: Tensor, cfg: LossParams) -> Tensor:
    """bool ``[B, T]``: the PPO clip is active (``L2 > L1``), ratio bounds from ``cfg``."""
    na = -advantages
    return na * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high) > na * ratio


_I32_MIN = -(2**31)
_CHUNK = 1 << 15  # tokens per candidate topk row (fits in cache; one batched topk for all rows)
_SCRATCH: dict[tuple[str, str], Tensor] = {}


def _scratch(slot: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D ``[n]`` work tensor (uninitialised) of the selection, only for temporaries that do
    not leave it. On CPU the largest one per slot is kept and reused: a fresh tensor of a
    mini-batch's size costs a page fault per 4 KiB page on every call (large allocations go
    back to the system when freed), more than the arithmetic on it; elsewhere (the CUDA
    caching allocator reuses memory by itself) a new tensor."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    key = (slot, str(dtype))
    have = _SCRATCH.get(key)
    if have is None or have.numel() < n:
        have = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return have[:n]


def _cat_into(slot: str, xs: list[Tensor], dtype: torch.dtype, n: int) -> Tensor:
    """The micro-batches' tensors flattened row-major and concatenated into a scratch tensor
    ``[sum B_m T_m]`` of ``dtype`` (converted while copying), or a view of them when they are
    adjacent already (:func:`adjacent_view`): the result is never written to."""
    view = adjacent_view(xs, dtype, n)
    if view is not None:
        return view
    out = _scratch(slot, n, dtype, xs[0].device)
    if all(x.dtype == dtype for x in xs):
        return torch.cat([x.reshape(-1) for x in xs], out=out)
    start = 0
    for x in xs:
        out[start:start + x.numel()].view(x.shape).copy_(x)
        start += x.numel()
    return out


def _flat_means(ctx: ReductionContext, lp: Tensor, a: Tensor, vbits: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_cov_means` on the flat fp32 ``lp``, ``a`` (``[N]``; padding zeroed by the int32
    ``vbits`` words): fp64 sums of the exact fp64 values and products, one ``all_reduce``."""
    n, device = lp.numel(), lp.device
    tmp = _scratch("i32_t", n, torch.int32, device)
    xy = _scratch("f64_xy", 2 * n, torch.float64, device).view(2, n)
    x, y = xy[0], xy[1]
    x.copy_(torch.bitwise_and(lp.view(torch.int32), vbits, out=tmp).view(torch.float32))
    y.copy_(torch.bitwise_and(a.view(torch.int32), vbits, out=tmp).view(torch.float32))
    sums = torch.cat([xy.sum(1), torch.dot(x, y).view(1)])
    ctx.all_reduce(sums)
    num = ctx.num_tokens.clamp_min(1).double()
    mean_lp, mean_a = sums[0] / num, sums[1] / num
    batch_cov = sums[2] / num - mean_lp * mean_a
    return mean_lp.float(), mean_a.float(), batch_cov


def _order_bits_into(out: Tensor, bits: Tensor) -> Tensor:
    """int32 whose **signed** order is the order of the fp32 values with int32 ``bits``
    (``b ^ ((b >> 31) & 0x7FFFFFFF)``; all-ones bits, a NaN, give the minimum), into ``out``."""
    torch.bitwise_right_shift(bits, 31, out=out)
    return out.bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)


def _rev_index(ctx: ReductionContext, ms: list[Tensor], n: int, device: torch.device) -> Tensor:
    """Flat int32 low key words ``2**31 - 1 - global token index`` ``[n]`` of this rank's
    micro-batches (>= 1): with one rank and rows in order the flat position stands in for the
    index (the same order)."""
    if (ctx.group is None or ctx.dp_size == 1) and ctx.seq_ids is None:
        return reversed_index32(n, device)
    g = global_token_index(ctx, [m.shape for m in ms], device)
    g = torch.cat([x.reshape(-1) for x in g]) if len(g) > 1 else g[0].reshape(-1)
    return ((2**31 - 1) - g).to(torch.int32)


def _key_into(high: Tensor, low: Tensor, rows: int, width: int) -> Tensor:
    """Word keys ``high * 2**32 + low`` (int32 ``[n]`` each, ``low >= 0``) in a scratch
    ``[rows, width]`` int64, the positions past ``n`` :data:`INACTIVE`."""
    n = high.numel()
    key = _scratch("i64_key", rows * width, torch.int64, high.device)
    head = key[:n]
    if sys.byteorder == "little":  # low word first: write the two int32 halves
        head.copy_(low)  # low >= 0: the high word is 0
        head.view(torch.int32).view(n, 2)[:, 1].copy_(high)
    else:
        head.copy_(high).bitwise_left_shift_(32).bitwise_or_(low.to(torch.int64))
    key[n:].fill_(INACTIVE)
    return key.view(rows, width)


@torch.no_grad()
def select_cov_tokens(ctx: ReductionContext, cfg: LossParams, stat_logp: TensorList,
                      old_logp: TensorList, advantages: TensorList, masks: TensorList,
                      step: int | Tensor = 0, salt: int = 0) -> CovSelection:
    """Global Clip-Cov / KL-Cov token selection for this rank's micro-batches (``cfg.policy_loss``
    picks the rule). Inputs are per-micro-batch ``[B_m, T_m]`` lists (or one tensor) in the
    order used by ``ctx``. Clip-Cov's random keys depend on ``(cov_seed, salt, step, global
    sequence index, position)``, never on the layout; the trainer's ``salt`` is
    ``epoch * 65536 + mini-batch`` so every epoch and mini-batch draws its own tokens.
    The micro-batches are concatenated once and every step runs in place on the flat tensors
    (a few dozen kernels whatever the number of micro-batches): the global means, the
    covariance, the keys, one batched ``topk`` of ``32768``-token rows, one ``topk`` over
    their candidates.
    Collectives with several DP ranks: 1 ``all_reduce`` (means) + 1 ``all_gather`` of each
    rank's candidates (keys, Cov values, active count) when ``ctx.numel_bound`` is known (one
    process, gloo, or given by the caller); else a radix selection (4 ``all_reduce``) + 1 for
    the metrics. None with one rank; no host sync. Ties in the score go to the smaller global
    token index: with one DP rank the flat position stands in for it (same order, see
    ``context.py``). Log-probs and advantages enter the per-token steps in fp32.
    """
    if cfg.policy_loss not in ("clip_cov", "kl_cov"):
        raise LossConfigError(f"select_cov_tokens needs policy_loss 'clip_cov' or 'kl_cov', got "
                              f"{cfg.policy_loss!r}")
    lp_l, old_l, adv_l = as_list(stat_logp), as_list(old_logp), as_list(advantages)
    ms = [m.bool() for m in as_list(masks)]
    device, n = lp_l[0].device, sum(m.numel() for m in ms)
    f32, i32 = torch.float32, torch.int32
    valid = _cat_into("b_valid", ms, torch.bool, n)
    n_pad = -(-n // _BLOCK) * _BLOCK  # whole blocks for the block top-k; the tail is inactive
    vbits_p = _scratch("i32_v", n_pad, i32, device)
    vbits_p[n:].zero_()
    vbits = vbits_p[:n].copy_(valid).neg_()  # mask_bits: -1 / 0 words
    lp, adv = _cat_into("f32_lp", lp_l, f32, n), _cat_into("f32_a", adv_l, f32, n)
    if all(x.dtype == f32 for x in lp_l + adv_l):
        mean_lp, mean_a, batch_cov = _flat_means(ctx, lp, adv, vbits)
    else:
        mean_lp, mean_a, batch_cov = _cov_means(ctx, lp_l, adv_l, ms)
    cov = torch.sub(lp, mean_lp, out=_scratch("f32_cov", n, f32, device))  # _token_cov, flat
    cov.mul_(torch.sub(adv, mean_a, out=_scratch("f32_t", n, f32, device)))
    high_p = _scratch("i32_h", n_pad, i32, device)
    high_p[n:].fill_(_I32_MIN)
    high = high_p[:n]
    if cfg.policy_loss == "kl_cov":
        bits = torch.bitwise_or(cov.view(i32), vbits.bitwise_not_(),  # padding: all-ones bits
                                out=_scratch("i32_t", n, i32, device))
        _order_bits_into(high, bits)
        vbits.bitwise_not_()  # back to the valid words: the active tokens
        one_rank = ctx.group is None or ctx.dp_size == 1
        active_count = ctx.num_tokens if one_rank else count_true(valid)
        ratio_k = cfg.kl_cov_ratio
        act_p = vbits_p
    else:
        active_p = _scratch("b_act", n_pad, torch.bool, device)
        active_p[n:].fill_(False)
        active = compare("gt", cov, cfg.clip_cov_lb, out=active_p[:n])
        active.logical_and_(compare("lt", cov, cfg.clip_cov_ub,
                                    out=_scratch("b_t", n, torch.bool, device)))
        active.logical_and_(valid)
        if any(x is not o for x, o in zip(lp_l, old_l, strict=True)):
            # the statistic's own old log-probs: ratio 1, never clipped; else -A c > -A r is
            # A c < A r exactly (negation is exact; NaN: false in both)
            old = _cat_into("f32_old", old_l, f32, n)
            r = torch.sub(lp, old, out=_scratch("f32_t", n, f32, device)).exp_()
            c = torch.clamp(r, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high,
                            out=_scratch("f32_c", n, f32, device)).mul_(adv)
            clipped = compare("lt", c, r.mul_(adv), out=_scratch("b_t", n, torch.bool, device))
            active.logical_and_(clipped.logical_not_())
        seed = (int(cfg.cov_seed) + int(salt) * 0x9E3779B1) & 0xFFFFFFFF
        _flat_hash_into(high, _scratch("i32_t", n, i32, device), seed, step, ctx, ms)
        # inactive: high = INT32_MIN (``active`` tells them from a hash at the minimum)
        mul_mask_(high, active).bitwise_xor_(_I32_MIN)
        active_count = count_true(active)
        ratio_k = cfg.clip_cov_ratio
        act_p = active_p
    sel, top = _word_top(ctx, high_p, act_p, n, ms, cov, active_count, ratio_k)
    num_tok = ctx.num_tokens.clamp_min(1).double()
    num = top.count.double()
    name = cfg.policy_loss
    stats = {"cov/batch_cov": batch_cov.float(),
             "cov/mean_selected": (top.value_sum / num.clamp_min(1)).float(),
             f"{name}/num_selected": num.float(),
             f"{name}/selected_frac": (num / num_tok).float(),
             f"{name}/candidate_frac": (top.active.double() / num_tok).float()}
    return CovSelection(_unflat(sel, ms), stats)


def _flat_hash_into(h: Tensor, tmp: Tensor, seed: int, step: int | Tensor,
                    ctx: ReductionContext, ms: list[Tensor]) -> Tensor:
    """Flat int32 :func:`token_hash32` bits of this rank's micro-batches into ``h``
    ``[sum B_m T_m]`` (``tmp``: int32 scratch of the same size): the per-row and per-position
    parts XORed (one broadcast when every micro-batch has the same length), then the finaliser
    in place."""
    device = h.device
    if ctx.seq_ids is None:  # this rank's rows in order: one arange for all micro-batches
        rows = [ctx.seq_offset.to(device) + torch.arange(sum(m.shape[0] for m in ms),
                                                         device=device)]
    else:
        rows = [ctx.seq_index(i, m.shape[0], device) for i, m in enumerate(ms)]
    h_seq, h_pos = token_hash_parts_premixed(seed, step, rows, [m.shape[1] for m in ms])
    t0 = ms[0].shape[1]
    if all(m.shape[1] == t0 for m in ms):
        torch.bitwise_xor(h_seq.unsqueeze(-1), h_pos[:t0].unsqueeze(0),
                          out=h.view(h_seq.numel(), t0))
    else:
        start, row = 0, 0
        for m in ms:
            b, t = m.shape
            torch.bitwise_xor(h_seq[row:row + b].unsqueeze(-1), h_pos[:t].unsqueeze(0),
                              out=h[start:start + b * t].view(b, t))
            start, row = start + b * t, row + b
    return fmix32_i32_(h, tmp, premixed=True)


def _flat_top(ctx: ReductionContext, key: Tensor, n: int, values: Tensor, active_count: Tensor,
              ratio: float) -> tuple[Tensor, TopK]:
    """The exact global top ``max(floor(ratio * N), 1)`` tokens by word key (``[rows, width]``
    from :func:`_key_into`, the first ``n`` real: score desc, global token index asc;
    :data:`INACTIVE`: never selected). With a host bound of the global size: one batched
    ``topk`` of ``k_max`` per row, then :func:`select_top_keys` over the candidates (one
    ``all_gather`` with several DP ranks); else the radix selection (four all-reduces).
    Returns the flat selected mask ``[n]`` (a new tensor) and the totals."""
    k = _count_k(ratio, ctx.num_tokens)
    device = key.device
    rows, width = key.shape
    one_rank = ctx.group is None or ctx.dp_size == 1
    bound = n if one_rank and ctx.seq_ids is None else ctx.numel_bound
    if bound is None:  # radix over device counts (no host bound of the global size)
        flat = key.reshape(-1)[:n]
        act = flat != INACTIVE
        radix_key = (((flat >> 32) + 2**31) << 31) | (flat & (2**31 - 1))  # non-negative
        sel = global_topk_mask(radix_key, act, k, ctx)
        value_sum = torch.where(sel, values, 0.0).sum(dtype=torch.float64)
        sums = torch.stack([sel.sum().double(), value_sum, act.sum().double()])
        ctx.all_reduce(sums)
        return sel, TopK(sel, sums[0].to(torch.int64), sums[2].to(torch.int64), sums[1])
    k_max = topk_bound(ratio, bound)
    if n == 0:
        top_v = key.new_empty(0)
        pos = torch.empty(0, dtype=torch.int64, device=device)
    else:
        top_v, top_i = torch.topk(key, min(k_max, width), dim=1, sorted=False)
        pos = top_i + torch.arange(0, rows * width, width, device=device).unsqueeze(-1)
        top_v, pos = top_v.reshape(-1), pos.reshape(-1)
    vals = values.gather(0, pos.clamp_max(max(n - 1, 0))) if n else values.new_empty(0)
    res = select_top_keys(top_v, vals, active_count, k, k_max, ctx)
    sel = torch.zeros(rows * width, dtype=torch.bool, device=device)
    sel = sel.scatter_(0, pos, res.selected)[:n]
    return sel, TopK(sel, res.count, res.active, res.value_sum)


_BLOCK = 128  # tokens per block of the block top-k (one int32 max per block)


def _word_top(ctx: ReductionContext, high_p: Tensor, act_p: Tensor, n: int, ms: list[Tensor],
              values: Tensor, active_count: Tensor, ratio: float) -> tuple[Tensor, TopK]:
    """The exact global top ``max(floor(ratio * N), 1)`` active tokens by (``high`` desc, global
    token index asc). ``high_p``: int32 ``[n_pad]`` (``n`` real tokens, then a tail to a whole
    number of :data:`_BLOCK`-token blocks with ``high = INT32_MIN``); ``act_p`` ``[n_pad]``: the
    active tokens, as bool or as int32 words (-1 / 0), false / 0 in the tail; an inactive
    token's ``high`` is ``INT32_MIN``.

    When this rank's flat positions are in global index order (no ``seq_ids``) and a host bound
    of the global size is known: :func:`_block_candidates`, then :func:`select_top_keys` over
    them (one ``all_gather`` with several DP ranks). Otherwise the full int64 keys go through
    :func:`_flat_top` (batched ``topk`` rows, or the radix selection without a bound)."""
    one_rank = ctx.group is None or ctx.dp_size == 1
    bound = n if one_rank and ctx.seq_ids is None else ctx.numel_bound
    if bound is None or ctx.seq_ids is not None or n == 0:
        high, act = high_p[:n], act_p[:n]
        rev = _rev_index(ctx, ms, n, high.device)
        low = _scratch("i32_l", n, torch.int32, high.device)
        if act.dtype == torch.bool:
            torch.mul(rev, act, out=low)
        else:
            torch.bitwise_and(rev, act, out=low)
        width = min(max(n, 1), _CHUNK)
        key = _key_into(high, low, -(-n // width), width)
        return _flat_top(ctx, key, n, values, active_count, ratio)
    k_max = topk_bound(ratio, bound)
    pos, keys = _block_candidates(ctx, high_p, act_p, n, ms, k_max)
    vals = values.gather(0, pos.clamp_max(n - 1))
    res = select_top_keys(keys, vals, active_count, _count_k(ratio, ctx.num_tokens), k_max, ctx)
    sel = torch.zeros(high_p.numel(), dtype=torch.bool, device=high_p.device)
    sel = sel.scatter_(0, pos, res.selected)[:n]
    return sel, TopK(sel, res.count, res.active, res.value_sum)


def _global_index_at(ctx: ReductionContext, ms: list[Tensor], pos: Tensor) -> Tensor:
    """Global token index ``seq_idx * max_len + t`` (int64) of the flat positions ``pos`` of
    this rank's micro-batches (``ms``: their ``[B_m, T_m]`` masks, rows in order: no
    ``seq_ids``), computed for those positions only."""
    device = pos.device
    widths = [m.shape[1] for m in ms]
    if all(t == widths[0] for t in widths):  # one [rows, T] matrix
        row, col = pos // widths[0], pos % widths[0]
    else:
        starts, rows_before, acc, acc_rows = [], [], 0, 0
        for m in ms:
            starts.append(acc)
            rows_before.append(acc_rows)
            acc, acc_rows = acc + m.numel(), acc_rows + m.shape[0]
        starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
        mb = torch.bucketize(pos, starts_t, right=True) - 1
        width = torch.tensor(widths, dtype=torch.int64, device=device)[mb]
        local = pos - starts_t[mb]
        row = torch.tensor(rows_before, dtype=torch.int64, device=device)[mb] + local // width
        col = local % width
    return (ctx.seq_offset.to(device) + row) * ctx.max_len.to(device) + col


def _block_candidates(ctx: ReductionContext, high_p: Tensor, act_p: Tensor, n: int,
                      ms: list[Tensor], k_max: int) -> tuple[Tensor, Tensor]:
    """Positions (int64 ``[c]``) and int64 keys (``high`` word, then the reversed global token
    index; :data:`INACTIVE` for inactive tokens) of the tokens of this rank's best ``k_max``
    blocks, which hold this rank's ``k_max`` best tokens.

    A block's key is (its largest ``high``, whether it has an active token, its position
    reversed). Every token e of the top ``k_max`` lies in one of the top ``k_max`` blocks: a
    block ranked above e's holds an active token with a larger ``high``, or with the same
    ``high`` and a smaller index (flat positions follow the global index here), so ``k_max``
    such blocks would put ``k_max`` tokens above e. One int32 max per block replaces the int64
    key of every token and a ``topk`` over all of them."""
    device = high_p.device
    nb = high_p.numel() // _BLOCK
    bmax = high_p.view(nb, _BLOCK).amax(1).to(torch.int64)
    if act_p.dtype == torch.bool:
        has_act = act_p.view(torch.uint8).view(nb, _BLOCK).amax(1).to(torch.int64) << 31
    else:  # -1 words: the minimum is -1 when some token is active
        has_act = act_p.view(nb, _BLOCK).amin(1).to(torch.int64) & (1 << 31)
    bkey = (bmax << 32) | has_act | torch.arange(2**31 - 1, 2**31 - 1 - nb, -1, device=device)
    blocks = torch.topk(bkey, min(k_max, nb), sorted=False).indices
    pos = (blocks.unsqueeze(-1) * _BLOCK
           + torch.arange(_BLOCK, device=device).unsqueeze(0)).reshape(-1)
    if ctx.group is None or ctx.dp_size == 1:  # the flat position stands in for the index
        rev = (2**31 - 1) - pos
    else:
        rev = (2**31 - 1) - _global_index_at(ctx, ms, pos.clamp_max(n - 1))
    keys = (high_p.gather(0, pos).to(torch.int64) << 32) | rev
    keys = torch.where(act_p.gather(0, pos) != 0, keys, INACTIVE)
    return pos, keys


@torch.no_grad()
def entropy_dynamics_diagnostic(ctx: ReductionContext, logp: TensorList, advantages: TensorList,
                                masks: TensorList, top_frac: float = 2e-4) -> dict[str, Tensor]:
    """§12 diagnostic: global batch ``Cov(log pi, A)`` and the mean ``Cov_t`` of the top
    ``top_frac`` tokens (default 0.02 %, i.e. ``max(floor(top_frac * N), 1)`` tokens) next to the
    mean over all tokens, so users see which tokens drive entropy collapse."""
    ms = [m.bool() for m in as_list(masks)]
    lp_l, adv_l = as_list(logp), as_list(advantages)
    mean_lp, mean_a, batch_cov = _cov_means(ctx, lp_l, adv_l, ms)
    n, device = sum(m.numel() for m in ms), ms[0].device
    valid = torch.cat([m.reshape(-1) for m in ms])
    n_pad = -(-n // _BLOCK) * _BLOCK  # whole blocks for _word_top; the tail is inactive
    vbits = torch.zeros(n_pad, dtype=torch.int32, device=device)
    vbits[:n] = mask_bits(valid, torch.float32)
    cov = (torch.cat([x.reshape(-1).float() for x in lp_l]) - mean_lp).mul_(
        torch.cat([x.reshape(-1).float() for x in adv_l]) - mean_a)
    bits = cov.view(torch.int32) | vbits[:n].bitwise_not()  # padding: all-ones bits
    high = torch.full((n_pad,), _I32_MIN, dtype=torch.int32, device=device)
    _order_bits_into(high[:n], bits)
    count = ctx.num_tokens if ctx.group is None or ctx.dp_size == 1 else count_true(valid)
    _, top = _word_top(ctx, high, vbits, n, ms, cov, count, top_frac)
    num = top.count.double()
    return {"entropy_dynamics/batch_cov": batch_cov.float(),
            "entropy_dynamics/cov_mean_all": batch_cov.float(),
            "entropy_dynamics/cov_mean_top": (top.value_sum / num.clamp_min(1)).float(),
            "entropy_dynamics/top_count": num.float()}


def _selected(inp: LossInputs, name: str) -> Tensor:
    if inp.cov_selected is None:
        raise ValueError(f"policy_loss={name!r} needs LossInputs.cov_selected: call "
                         "select_cov_tokens(...) once per mini-batch and pass each micro-batch "
                         "its slice")
    return inp.cov_selected.bool()


def _fusable(*xs: Tensor) -> bool:
    """The fused per-token losses below handle same-shape fp32/fp64 tensors of one dtype."""
    return (all(x.dtype == xs[0].dtype and x.shape == xs[0].shape for x in xs)
            and xs[0].dtype in (torch.float32, torch.float64))


def _bits_of(mask: Tensor, like: Tensor) -> Tensor:
    return mask_bits(mask, like.dtype)


def _valid_sum(x: Tensor, valid_bits: Tensor, valid: Tensor) -> Tensor:
    """``sum(x)`` over the valid tokens as ``mean_stat`` takes it (fp32 values summed in fp64),
    0-dim fp64."""
    if x.dtype != torch.float32:
        x, valid_bits = x.float(), _bits_of(valid, x.float())
    return zero_where_not(x, valid_bits).sum(dtype=torch.float64)




class _ClipCovLoss(torch.autograd.Function):
    """PPO-clip per-token loss, zero outside ``keep = valid & ~sel`` (padding and the selected
    tokens): ``masked_zero(masked_zero(maximum(-A r, -A clamp(r, lo, hi)), ~sel), mask)`` with
    ``r = exp(logp - old_logp)`` (the loss, then the aggregation's padding mask), in fewer
    kernels than autograd through that expression. The loss is bit-identical to it; the
    gradient has the same values (a zero may differ in sign; see :meth:`backward`).
    Second output: the metric sums ``[sum(old - logp), #valid, #selected, #clipped]`` (fp64,
    over the valid tokens), taken from the forward's own tensors."""

    @staticmethod
    def forward(ctx, logp: Tensor, old_logp: Tensor, adv: Tensor, valid: Tensor, sel: Tensor,
                lo: float, hi: float) -> tuple[Tensor, Tensor]:  # noqa: D102
        ctx.set_materialize_grads(False)
        # temporaries that do not leave the forward live in scratch buffers (warm in cache)
        lr = torch.sub(logp, old_logp, out=_tmp("cc_lr", logp))
        ratio = torch.exp(lr)
        na = torch.neg(adv, out=_tmp("cc_na", logp))
        loss1 = torch.mul(na, ratio, out=_tmp("cc_l1", logp))
        clamped = torch.clamp(ratio, lo, hi, out=_tmp("cc_c", logp))
        loss2 = torch.mul(na, clamped, out=_tmp("cc_l2", logp))
        iw = _INT_OF[logp.dtype]
        grad = ctx.needs_input_grad[0]
        m = _clip_masks(loss1, loss2, clamped, ratio, valid.contiguous(), sel.contiguous(), grad)
        words = _words_into("cc_w", m.stacked, iw)  # -1 / 0 words of valid, keep (and kc)
        loss = torch.maximum(loss1, loss2)
        loss.view(iw).bitwise_and_(words[1])
        # sum(old - logp) = -sum(lr) exactly (negation is exact); counts: valid, sel, clipped
        stats = torch.cat([_valid_sum_(lr, words[0], valid).neg().view(1), m.counts])
        if grad:
            w = (na.view(iw) & words[2]).view(na.dtype)
            ctx.save_for_backward(w.mul_(m.factor), ratio)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad: Tensor | None, _grad_stats: Tensor | None = None):  # noqa: D102
        """``(g w) r`` with the forward's weight ``w`` (:func:`_clip_grad_weight`): autograd's
        chain through ``maximum``, ``clamp`` and ``exp`` in two multiplications."""
        if grad is None:
            return None, None, None, None, None, None, None
        w, ratio = ctx.saved_tensors
        return (grad * w) * ratio, None, None, None, None, None, None


@dataclass
class _ClipMasks:
    """The bool work of one Clip-Cov forward (see :func:`_clip_masks`)."""

    stacked: Tensor  # bool [2 or 3, B, T]: valid, keep = valid & ~sel (and kc = keep & ~clipped)
    counts: Tensor  # fp64 [3]: #valid, #(sel & valid), #(clipped & valid)
    factor: Tensor | None  # fp32 [B, T]: 0.5 on kept ties outside the bounds, else 1 (grad only)


def _clip_masks(loss1: Tensor, loss2: Tensor, clamped: Tensor, ratio: Tensor, valid: Tensor,
                sel: Tensor, grad: bool) -> _ClipMasks:
    """The masks, counts and gradient factor of the PPO-clip loss ``max(loss1, loss2)``
    (``loss_i = -A r_i``, ``r_1 = r``, ``r_2 = clamp(r)``); one numpy pass per mask on CPU (the
    same IEEE comparisons, several times cheaper than torch's bool kernels there), torch ops
    elsewhere.

    The gradient (see :meth:`_ClipCovLoss.backward`) is ``(g w) r`` with ``w = -A * factor`` on
    the kept, unclipped tokens ``kc`` and 0 elsewhere. Autograd's chain: ``maximum`` gives ``g``
    to the larger side, ``g / 2`` to each on a tie, nothing to the smaller; each side times
    ``-A``; ``clamp`` passes its side's share inside the bounds only; the shares add up; times
    ``r``. So a clipped or masked token gets 0; a kept one inside the bounds gets
    ``2 ((g / 2) (-A)) = g (-A)`` (both sides tie and pass); outside the bounds only the
    unclamped side passes: ``g (-A)``, or ``(g / 2) (-A)`` on a tie (factor 0.5). Halving is
    exact, so the products are autograd's values, except that a zero may carry the other sign
    and a non-finite upstream gradient reaches masked tokens (exact for finite ``g`` and
    ``|A| >= 2**-125``). Ties are compared as bits (``==`` differs only where a side is NaN);
    inside the bounds the two sides are the same product, so ``tie ^ inside`` is a tie outside.
    """
    host = [masking.host_array(x) for x in (loss1, loss2, clamped, ratio, valid, sel)]
    on_host = all(h is not None for h in host)  # numpy arrays and tensors share the operators
    if on_host:
        l1, l2, c, r, v, s = host
        def bits(x):  # the integer view of a float array (of a tensor below)
            return x.view(_NP_INT[x.dtype.itemsize])
    else:
        l1, l2, c, r, v, s = loss1, loss2, clamped, ratio, valid, sel
        def bits(x):
            return x.view(_INT_OF[x.dtype])
    clipped = l2 > l1  # maximum's backward: loss1 gets no gradient here
    keep = v & ~s
    masks, sv, cv = [v, keep], s & v, clipped & v
    half = None
    if grad:
        kc = keep & ~clipped
        masks.append(kc)
        half = ((bits(l1) == bits(l2)) ^ (bits(c) == bits(r))) & kc
    if on_host:
        import numpy as np

        counts = counts_f64(*(torch.from_numpy(x) for x in (v, sv, cv)))
        stacked = torch.from_numpy(np.stack(masks))
        half = None if half is None else torch.from_numpy(half)
    else:
        counts, stacked = counts_f64(v, sv, cv), torch.stack(masks)
    factor = None if half is None else torch.add(1.0, half.to(loss1.dtype), alpha=-0.5)
    return _ClipMasks(stacked, counts, factor)


_NP_INT = {8: "int64", 4: "int32", 2: "int16"}


_TMP: dict[str, Tensor] = {}


def _tmp(slot: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A scratch tensor of ``like``'s shape and device (and dtype, unless given) for a temporary
    of a fused loss's forward (see :func:`_scratch`: reused on CPU, where a warm buffer saves a
    trip to memory; the last shaped view per slot is kept, as micro-batches mostly repeat their
    shape). Elsewhere a new tensor."""
    dtype = like.dtype if dtype is None else dtype
    if like.device.type != "cpu":
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    have = _TMP.get(slot)
    if have is None or have.shape != like.shape or have.dtype != dtype:
        have = _TMP[slot] = _scratch(slot, like.numel(), dtype, like.device).view(like.shape)
    return have


def _words_into(slot: str, mask: Tensor, iw: torch.dtype) -> Tensor:
    """:func:`_words` of ``mask`` into a scratch tensor (a temporary of the forward)."""
    return _tmp(slot, mask, iw).copy_(-mask.view(torch.int8))


def _valid_sum_(x: Tensor, valid_bits: Tensor, valid: Tensor) -> Tensor:
    """:func:`_valid_sum` that may zero ``x``'s padding in place (a scratch temporary)."""
    if x.dtype != torch.float32:
        return _valid_sum(x, valid_bits, valid)
    x.view(torch.int32).bitwise_and_(valid_bits)
    return x.sum(dtype=torch.float64)


def _words(mask: Tensor, iw: torch.dtype) -> Tensor:
    """:func:`mask_bits` of a contiguous bool ``mask`` as integer type ``iw`` (-1 / 0 words)."""
    return (-mask.view(torch.int8)).to(iw)




def clip_cov_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§4 Clip-Cov: PPO-clip (no dual clip, no log-ratio clamp) with the selected tokens'
    loss and gradient zeroed; they still count in the denominator."""
    sel = _selected(inp, "clip_cov")
    a = inp.advantages
    lo, hi = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    m = inp.mask
    if _fusable(inp.logp, inp.old_logp, a) and sel.shape == m.shape == inp.logp.shape:
        valid = m.bool()
        loss, st = _ClipCovLoss.apply(inp.logp, inp.old_logp, a, valid, sel, lo, hi)
        kl, n_valid, n_sel, n_clip = st.unbind()
        stats = {"clip_cov/zeroed_frac": ratio_stat(n_sel, n_valid),
                 "policy/clip_frac": ratio_stat(n_clip, n_valid),
                 "policy/ppo_kl": ratio_stat(kl, n_valid)}
        return TokenLoss(loss, stats, premasked=True)
    ratio = torch.exp(log_ratio(inp.logp, inp.old_logp, None))
    loss1 = -a * ratio
    loss2 = -a * ratio.clamp(lo, hi)
    loss, clipped = masked_zero(torch.maximum(loss1, loss2), ~sel), loss2 > loss1
    stats = {"clip_cov/zeroed_frac": mean_stat(sel, m),
             "policy/clip_frac": mean_stat(clipped, m),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats, premasked=False)


class _KLCovLoss(torch.autograd.Function):
    """``masked_zero(-A exp(lr) + masked_zero(coef * |lr|, sel), mask)`` with
    ``lr = logp - old_logp`` (the loss, then the aggregation's padding mask), in fewer kernels
    than autograd through that expression: the loss bit-identical to it, the gradient with the
    same values (see :meth:`backward`). Second output: the metric sums ``[sum(old - logp),
    sum |lr|, #valid, #selected]`` (fp64, over the valid tokens)."""

    @staticmethod
    def forward(ctx, logp: Tensor, old_logp: Tensor, adv: Tensor, sel: Tensor, valid: Tensor,
                coef: float) -> tuple[Tensor, Tensor]:  # noqa: D102
        ctx.set_materialize_grads(False)
        # temporaries that do not leave the forward live in scratch buffers (warm in cache)
        lr = torch.sub(logp, old_logp, out=_tmp("kl_lr", logp))
        e = torch.exp(lr)
        na = torch.neg(adv, out=_tmp("kl_na", logp))
        abs_lr = torch.abs(lr, out=_tmp("kl_abs", logp))
        valid, sel = valid.contiguous(), sel.contiguous()
        iw = _INT_OF[logp.dtype]
        sv = sel & valid
        sel_bits, valid_bits, sv_bits = _words_into("kl_w", torch.stack([sel, valid, sv]), iw)
        pen = torch.mul(abs_lr, coef, out=_tmp("kl_pen", logp))
        pen.view(iw).bitwise_and_(sel_bits)
        loss = torch.mul(na, e).add_(pen)
        loss.view(iw).bitwise_and_(valid_bits)
        if ctx.needs_input_grad[0]:
            # the gradient's per-token factors: -A on the valid tokens, coef * sign(lr) on the
            # selected ones (0 elsewhere)
            g_pen = torch.sgn(lr).mul_(coef)
            g_pen.view(iw).bitwise_and_(sv_bits)
            ctx.save_for_backward(zero_where_not(na, valid_bits), e, g_pen)
        # sum(old - logp) = -sum(lr) exactly (negation is exact); counts: valid, sel
        stats = torch.cat([torch.stack([_valid_sum_(lr, valid_bits, valid).neg(),
                                        _valid_sum_(abs_lr, valid_bits, valid)]),
                           counts_f64(valid, sv)])
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad: Tensor | None, _grad_stats: Tensor | None = None):  # noqa: D102
        """``(g w) e + g p`` with ``w = -A`` and ``p = coef sign(lr)`` (0 where masked):
        autograd's ``(g (-A)) e + (g coef) sign(lr)`` on the kept tokens (multiplying by
        ``sign`` is exact, so ``g (coef sign)`` is the same number); a masked token gets a zero
        (autograd's may carry the other sign)."""
        if grad is None:
            return None, None, None, None, None, None
        w, e, pen = ctx.saved_tensors
        return (grad * w) * e + grad * pen, None, None, None, None, None


def kl_cov_token_loss(inp: LossInputs, cfg: LossParams) -> TokenLoss:
    """§4 KL-Cov: ``-A r`` (no clipping) plus ``kl_cov_coef * |logp - old_logp|`` on the selected
    tokens."""
    sel = _selected(inp, "kl_cov")
    m = inp.mask
    if (_fusable(inp.logp, inp.old_logp, inp.advantages)
            and sel.shape == m.shape == inp.logp.shape):
        loss, st = _KLCovLoss.apply(inp.logp, inp.old_logp, inp.advantages, sel, m.bool(),
                                    float(cfg.kl_cov_coef))
        kl, abs_sum, n_valid, n_sel = st.unbind()
        stats = {"kl_cov/penalised_frac": ratio_stat(n_sel, n_valid),
                 "policy/abs_log_ratio": ratio_stat(abs_sum, n_valid),
                 "policy/ppo_kl": ratio_stat(kl, n_valid)}
        return TokenLoss(loss, stats, premasked=True)
    lr = log_ratio(inp.logp, inp.old_logp, None)
    loss = -inp.advantages * torch.exp(lr)
    abs_lr = lr.abs()
    loss = loss + masked_zero(cfg.kl_cov_coef * abs_lr, sel)
    stats = {"kl_cov/penalised_frac": mean_stat(sel, m),
             "policy/abs_log_ratio": mean_stat(abs_lr, m),
             **ppo_kl_stat(inp.logp, inp.old_logp, inp.mask)}
    return TokenLoss(loss, stats, premasked=False)
