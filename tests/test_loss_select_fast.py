"""The fast single-process Clip-Cov / KL-Cov selection (one ``topk``, int32 hash, bit masking) is
the exact global selection: identical tokens to the radix selection with global token indices
(the multi-rank path), including ties, signed zeros and fewer candidates than ``k`` (issue 23
item 4). Layout invariance across DP/micro-batch splits is tested in ``test_loss_layout.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.loss import LossConfig, ReductionContext, select_cov_tokens
from megatron_rl.loss.cov import _count_k, _flat, ppo_clipped, token_covariance
from megatron_rl.loss.masking import masked_zero, zero_where_not
from megatron_rl.loss.select import (
    composite_key,
    float_order_key,
    global_token_index,
    global_topk_mask,
    mask_bits,
    token_hash32,
    token_hash32_flat,
)


def _fmix32_py(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_token_hash_matches_a_pure_python_murmur3_reference():
    seq, pos = torch.tensor([0, 5, 2**33 + 7]), torch.arange(40)
    out = token_hash32(123, 9, seq, pos)
    for i, s in enumerate(seq.tolist()):
        hs = _fmix32_py(_fmix32_py(_fmix32_py((s & 0xFFFFFFFF) ^ 123) ^ (s >> 32)) ^ 9)
        for p in pos.tolist():
            assert out[i, p].item() == _fmix32_py(hs ^ _fmix32_py(_fmix32_py(p ^ 0x9E3779B9)))
    seqs, lens = [torch.tensor([3, 4]), torch.tensor([9]), torch.tensor([2**32 + 1, 2])], [5, 9, 3]
    flat = token_hash32_flat(7, 2, seqs, lens)
    assert torch.equal(flat, torch.cat([token_hash32(7, 2, s, torch.arange(t)).reshape(-1)
                                        for s, t in zip(seqs, lens)]))


def test_topk_path_equals_radix_path():
    g = torch.Generator().manual_seed(0)
    for n, k, frac in [(1000, 7, 0.5), (1000, 600, 0.5), (300, 5, 0.0), (1, 1, 1.0),
                       (5000, 1, 0.01), (64, 64, 1.0)]:
        keys = torch.randperm(4 * n, generator=g)[:n].to(torch.int64) * 977 + 3
        active = torch.rand(n, generator=g) < frac
        ctx = ReductionContext.from_minibatch(torch.ones(1, n, dtype=torch.bool), group=None)
        kt = torch.tensor(k)
        radix = global_topk_mask(keys, active, kt, ctx)
        fast = global_topk_mask(keys, active, kt, ctx, k_max=k + 3)
        assert torch.equal(radix, fast), (n, k, frac)
        assert int(fast.sum()) == min(k, int(active.sum()))


def _reference_selection(cfg, lp, old, adv, masks, step):
    """The selection with global-index composite keys and the radix top-k (multi-rank form)."""
    ctx = ReductionContext.from_minibatch(masks, group=None)
    cov, _ = token_covariance(ctx, lp, adv, masks)
    idx = _flat(global_token_index(ctx, [m.shape for m in masks], torch.device("cpu")))
    valid, cov_f = _flat(masks), _flat(cov)
    if cfg.policy_loss == "kl_cov":
        active, keys = valid, composite_key(float_order_key(cov_f), idx)
        k = _count_k(cfg.kl_cov_ratio, ctx.num_tokens)
    else:
        clipped = _flat([ppo_clipped(torch.exp(x - o), a, cfg) for x, o, a in zip(lp, old, adv)])
        active = valid & (cov_f > cfg.clip_cov_lb) & (cov_f < cfg.clip_cov_ub) & ~clipped
        rand = [token_hash32(cfg.cov_seed, step, ctx.seq_index(i, m.shape[0]),
                             torch.arange(m.shape[1])) for i, m in enumerate(masks)]
        keys = composite_key(_flat(rand), idx)
        k = _count_k(cfg.clip_cov_ratio, ctx.num_tokens)
    return global_topk_mask(keys, active, k, ctx)


def test_single_process_selection_equals_the_global_index_radix_selection():
    g = torch.Generator().manual_seed(1)
    shapes = [(3, 50), (4, 37), (2, 61)]
    masks = [torch.arange(t)[None] < torch.randint(1, t + 1, (b, 1), generator=g)
             for b, t in shapes]
    # quantised log-probs and advantages: many exactly tied and signed-zero covariances
    lp = [-(torch.randint(0, 6, (b, t), generator=g).float() / 2) for b, t in shapes]
    old = [x + torch.randn(x.shape, generator=g) * 0.1 for x in lp]
    adv = [torch.randint(-2, 3, (b, 1), generator=g).float().expand(b, t) for b, t in shapes]
    for cfg in (LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.03),
                LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.1)):
        ctx = ReductionContext.from_minibatch(masks, group=None)
        got = _flat(select_cov_tokens(ctx, cfg, lp, old, adv, masks, step=3).selected)
        want = _reference_selection(cfg, lp, old, adv, masks, 3)
        assert want.sum() > 1 and torch.equal(got, want), cfg.policy_loss
    # the first update's statistic is old_logp itself: Clip-Cov skips the PPO-clip test (ratio
    # exactly 1), the same tokens as computing it on an equal copy (NaN padding included)
    old_nan = [torch.where(m, o, float("nan")) for m, o in zip(masks, old)]
    copy = [o.clone() for o in old_nan]
    cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-10.0)
    fast = select_cov_tokens(ctx, cfg, old_nan, old_nan, adv, masks, step=3)
    full = select_cov_tokens(ctx, cfg, copy, old_nan, adv, masks, step=3)
    assert _flat(fast.selected).sum() > 1
    assert torch.equal(_flat(fast.selected), _flat(full.selected))
    assert fast.stats["clip_cov/candidate_frac"] == full.stats["clip_cov/candidate_frac"]


def test_bit_masking_equals_where_in_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -0.0
    m = torch.rand(4, 9, generator=g) < 0.5
    m[0, 0] = m[1, 1] = False
    m[2, 2] = True
    for dtype in (torch.float32, torch.float64):
        xd = x.to(dtype)
        ref = torch.where(m, xd, 0.0)
        out = zero_where_not(xd, mask_bits(m, dtype))
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))  # bit for bit
        a = xd.nan_to_num(0.0, 0.0, 0.0).clone().requires_grad_(True)
        b = a.detach().clone().requires_grad_(True)
        w = torch.randn(4, 9, generator=g, dtype=dtype)
        (masked_zero(a, m) * w).sum().backward()
        (torch.where(m, b, 0.0) * w).sum().backward()
        assert torch.equal(a.grad, b.grad)


def _edge_inputs(seed: int = 3):
    """Per-token inputs that hit every branch of the PPO-clip / KL-Cov backward: ratios exactly on
    the clip bounds and inside/outside, ties of the two PPO sides (A = 0 included), signed-zero
    log-ratios, padding with garbage."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 40, generator=g) * 3
    lr = torch.randn(6, 40, generator=g) * 0.3
    lr[0, :8] = torch.tensor([0.0, -0.0, 0.2, -0.2, 1e-9, -1e-9, 5.0, -5.0])
    logp = old + lr
    ratio = torch.exp(logp - old)
    # ratios exactly at the bounds: pick logp so that exp(logp - old) rounds to 0.8 / 1.2
    hits = 0
    for i in range(1, 6):
        for j in range(40):
            for b in (0.8, 1.2):
                cand = old[i, j] + torch.log(torch.tensor(b))
                if torch.exp(cand - old[i, j]) == torch.tensor(b, dtype=torch.float32):
                    logp[i, j], hits = cand, hits + 1
                    break
            if hits > 6:
                break
    adv = torch.randn(6, 40, generator=g)
    adv[:, ::7] = 0.0
    adv[2, ::5] = -0.0
    mask = torch.rand(6, 40, generator=g) < 0.8
    logp = torch.where(mask, logp, torch.tensor(float("nan")))  # padding garbage
    sel = (torch.rand(6, 40, generator=g) < 0.2) & mask
    return logp, old, adv, mask, sel, ratio, hits


def _same_values(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values (a zero of either sign equals a zero) and NaN at the same places."""
    nan = x.isnan()
    return torch.equal(nan, y.isnan()) and torch.equal(x[~nan], y[~nan])


def test_fused_cov_losses_bit_identical_to_autograd():
    """The fused Clip-Cov / KL-Cov per-token losses (custom backward, premasked aggregation) give
    the loss of the plain autograd expressions bit for bit (signed zeros too) and the gradient
    with the same values (a zero may carry the other sign)."""
    from megatron_rl.loss import LossInputs
    from megatron_rl.loss.aggregation import aggregate
    from megatron_rl.loss.cov import clip_cov_token_loss, kl_cov_token_loss

    logp0, old, adv, mask, sel, _, hits = _edge_inputs()
    assert hits > 3
    ctx = ReductionContext.from_minibatch(mask, group=None)
    for name in ("clip_cov", "kl_cov"):
        cfg = LossConfig(policy_loss=name, clip_ratio_low=0.2, clip_ratio_high=0.2,
                         kl_cov_coef=0.7)
        a = logp0.clone().requires_grad_(True)
        tok = (clip_cov_token_loss if name == "clip_cov" else kl_cov_token_loss)(
            LossInputs(a, old, adv, mask, cov_selected=sel), cfg)
        assert tok.premasked
        out = aggregate(tok.loss, mask, "seq-mean-token-mean", ctx, premasked=True)
        out.backward()
        b = logp0.clone().requires_grad_(True)
        lr = b - old
        if name == "clip_cov":
            r = torch.exp(lr)
            ref = masked_zero(torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)), ~sel)
        else:
            ref = -adv * torch.exp(lr) + masked_zero(0.7 * lr.abs(), sel)
        ref_out = aggregate(ref, mask, "seq-mean-token-mean", ctx)
        ref_out.backward()
        assert torch.equal(out.view(torch.int32), ref_out.view(torch.int32)), name
        assert torch.equal(tok.loss.detach().view(torch.int32),
                           masked_zero(ref, mask).detach().view(torch.int32)), name
        assert _same_values(a.grad, b.grad), name


def test_chunked_selection_with_dp_candidates_equals_radix():
    """The candidate exchange (per-micro-batch topk, then one topk of the candidates) selects the
    same tokens as the radix selection over all tokens, when k exceeds one micro-batch's share
    and with fewer active tokens than k."""
    from megatron_rl.loss.select import INACTIVE, select_top_keys_chunks

    g = torch.Generator().manual_seed(5)
    for n_chunks, n, k, frac in [(4, 50, 7, 0.5), (3, 40, 100, 0.3), (5, 30, 12, 1.0)]:
        keys = torch.randperm(10 * n * n_chunks, generator=g)[:n * n_chunks] * 3 + 1
        active = torch.rand(n * n_chunks, generator=g) < frac
        masked = torch.where(active, keys, INACTIVE)
        vals = torch.randn(n * n_chunks, generator=g)
        ctx = ReductionContext.from_minibatch(torch.ones(1, n * n_chunks, dtype=torch.bool),
                                              group=None)
        kt = torch.tensor(k)
        sel, top = select_top_keys_chunks(list(masked.split(n)), list(vals.split(n)),
                                          active.sum(), kt, k + 2, ctx)
        want = global_topk_mask(keys, active, kt, ctx)
        assert torch.equal(torch.cat(sel), want)
        assert int(top.count) == int(want.sum())
        assert torch.allclose(top.value_sum, vals[want].double().sum())


def test_rank_token_bound_sizes_the_candidate_exchange_and_is_checked():
    """The trainer's per-rank bound (rows x maximum sequence length) sets ``numel_bound`` without
    reading device counts (NCCL's case; the DP=2 gloo run in ``test_loss_layout.py`` selects the
    same tokens with it), and a bound below this rank's padded tokens is a clear error."""
    import pytest

    from megatron_rl.loss.context import rank_token_bound

    masks = [torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 7, dtype=torch.bool)]
    bound = rank_token_bound(masks, 8)
    assert bound == 4 * 8 and rank_token_bound(masks, None) is None
    assert ReductionContext.from_minibatch(masks, group=None,
                                           rank_numel_bound=bound).numel_bound == bound
    with pytest.raises(ValueError, match=r"rank_numel_bound=23\).*24 padded tokens"):
        ReductionContext.from_minibatch(masks, group=None, rank_numel_bound=23)


def test_selection_results_survive_the_next_call_and_fused_metrics_are_exact():
    """The selection works in scratch buffers reused between calls: a result must not change
    when the next mini-batch is selected. The fused Clip-Cov / KL-Cov losses return their metric
    sums (``ratio`` records); reduced, they equal the masked means re-derived here in float64."""
    from megatron_rl.loss import LossInputs, MetricAccumulator
    from megatron_rl.loss.cov import clip_cov_token_loss, kl_cov_token_loss

    g = torch.Generator().manual_seed(7)
    masks = [torch.arange(40)[None] < torch.randint(1, 41, (3, 1), generator=g) for _ in range(2)]
    lp = [-torch.rand(3, 40, generator=g) * 3 for _ in range(2)]
    old = [x + torch.randn(3, 40, generator=g) * 0.3 for x in lp]
    adv = [torch.randn(3, 1, generator=g).expand(3, 40) for _ in range(2)]
    cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-10.0,
                     clip_cov_ub=10.0)
    ctx = ReductionContext.from_minibatch(masks, group=None)
    first = select_cov_tokens(ctx, cfg, lp, old, adv, masks, step=1)
    kept = [s.clone() for s in first.selected]
    other = select_cov_tokens(ctx, cfg, old, lp, adv, masks, step=2)  # other keys, same sizes
    assert not all(torch.equal(a, b) for a, b in zip(kept, other.selected))
    assert all(torch.equal(a, b) for a, b in zip(kept, first.selected))
    for name, fn in (("clip_cov", clip_cov_token_loss), ("kl_cov", kl_cov_token_loss)):
        c = LossConfig(policy_loss=name, clip_ratio_low=0.2, clip_ratio_high=0.2)
        acc = MetricAccumulator()
        for x, o, a, m, s in zip(lp, old, adv, masks, first.selected):
            acc.update(fn(LossInputs(x.clone().requires_grad_(True), o, a, m,
                                     cov_selected=s), c).stats)
        got = acc.reduce(ctx)
        v = torch.cat([m.reshape(-1) for m in masks])
        x, o = torch.cat([t.reshape(-1) for t in lp]), torch.cat([t.reshape(-1) for t in old])
        a = torch.cat([t.reshape(-1) for t in adv])
        s = torch.cat([t.reshape(-1) for t in first.selected])
        r = torch.exp(x - o)
        want = {"policy/ppo_kl": (o - x).double()[v].mean(),
                f"{'clip_cov/zeroed' if name == 'clip_cov' else 'kl_cov/penalised'}_frac":
                    s[v].double().mean()}
        if name == "clip_cov":
            want["policy/clip_frac"] = ((-a * r.clamp(0.8, 1.2)) > (-a * r))[v].double().mean()
        else:
            want["policy/abs_log_ratio"] = (x - o).abs().double()[v].mean()
        for k, w in want.items():
            assert torch.allclose(got[k].double(), w, rtol=1e-6, atol=0), (name, k)
        assert 0 < float(got[list(want)[1]]) < 1


def test_ratio_records_reduce_like_means_in_both_accumulator_paths():
    """``ratio`` records (sums taken by the loss) give ``sum(num) / sum(den)`` whether the
    accumulator keeps its vector (same records every micro-batch) or per-name sums."""
    from megatron_rl.loss import MetricAccumulator
    from megatron_rl.loss.metrics import TokenStat, ratio_stat

    ctx = ReductionContext.from_minibatch(torch.ones(1, 4, dtype=torch.bool), group=None)
    f64 = torch.float64
    for extra in (False, True):  # True: a record appears later, the per-name path
        acc = MetricAccumulator()
        acc.update({"r": ratio_stat(torch.tensor(3.0, dtype=f64), torch.tensor(4.0, dtype=f64))})
        second = {"r": ratio_stat(torch.tensor(1.0, dtype=f64), torch.tensor(6.0, dtype=f64))}
        if extra:
            second["s"] = TokenStat(torch.tensor(2.0), None, "sum")
        acc.update(second)
        assert acc.reduce(ctx)["r"] == torch.tensor(0.4)  # fp32 of 4 / 10


def test_hash_parts_host_and_tensor_rounds_equal_the_reference():
    """The per-sequence hash part is taken in numpy on CPU with a host step and in int32 tensor
    rounds otherwise; both give :func:`token_hash32`'s bits (64-bit sequence indices too)."""
    from megatron_rl.loss.select import _fmix32_i32, token_hash_parts, unsigned_i64

    seqs = [torch.tensor([0, 5, 2**33 + 7, 2**31 + 3]), torch.tensor([2**40 - 1])]
    for step in (3, 2**32 + 5, torch.tensor(2**31 + 9)):
        for seed in (0, 0xDEADBEEF):
            hs, hp = token_hash_parts(seed, step, seqs, [6, 6])
            ref = token_hash32(seed, step, torch.cat(seqs), torch.arange(6))
            assert torch.equal(unsigned_i64(_fmix32_i32(hs[:, None] ^ hp[None])), ref)


def test_block_topk_is_exact_with_ties_across_blocks_and_minimum_words():
    """The block top-k (one int32 max per 128-token block, then the best blocks' tokens) selects
    exactly the radix selection's tokens when score words tie across many blocks, when active
    tokens sit at the minimum word beside inactive ones, and with fewer active tokens than k."""
    from megatron_rl.loss.cov import _BLOCK, _word_top

    g = torch.Generator().manual_seed(11)
    n = _BLOCK * 400 + 17  # 401 blocks: more than the k_max of every case below
    n_pad = -(-n // _BLOCK) * _BLOCK
    ctx = ReductionContext.from_minibatch(torch.ones(1, n, dtype=torch.bool), group=None)
    idx = torch.arange(n)
    for frac, levels, ratio in [(0.5, 3, 0.001), (0.02, 2, 0.005), (0.9, 1, 0.0003),
                                (0.3, 1000, 0.002), (0.0003, 1, 0.005), (0.01, 1, 0.0005)]:
        active = torch.rand(n, generator=g) < frac
        high = torch.randint(0, levels, (n,), generator=g).to(torch.int32) - 2**31  # ties
        high = torch.where(active, high, torch.tensor(-(2**31), dtype=torch.int32))
        high_p = torch.full((n_pad,), -(2**31), dtype=torch.int32)
        act_p = torch.zeros(n_pad, dtype=torch.int32)
        high_p[:n], act_p[:n] = high, -active.to(torch.int32)
        values = torch.randn(n, generator=g)
        keys = composite_key(high.to(torch.int64) + 2**31, idx)
        want = global_topk_mask(keys, active, _count_k(ratio, torch.tensor(n)), ctx)
        for act in (act_p, act_p != 0):  # int32 words (KL-Cov) or bool (Clip-Cov)
            sel, top = _word_top(ctx, high_p, act, n, [torch.ones(1, n, dtype=torch.bool)],
                                 values, active.sum(), ratio)
            assert torch.equal(sel, want), (frac, levels, ratio, act.dtype)
            assert int(top.count) == int(want.sum()) > 0
            assert torch.allclose(top.value_sum, values[want].double().sum())


def test_selection_reads_adjacent_micro_batch_views_without_copying_or_writing():
    """Micro-batches that are row slices of one mini-batch tensor are read in place (no
    concatenation): the same tokens as from separate copies, and the inputs are unchanged."""
    g = torch.Generator().manual_seed(12)
    b, t = 12, 300
    mask = torch.arange(t)[None] < torch.randint(20, t + 1, (b, 1), generator=g)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    before = [x.clone() for x in (lp, old, adv, mask)]
    cut = [slice(0, 4), slice(4, 8), slice(8, 12)]
    for cfg in (LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.01),
                LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.01, clip_cov_lb=-5.0)):
        views = [[x[s] for s in cut] for x in (lp, old, adv, mask)]
        copies = [[x[s].clone() for s in cut] for x in (lp, old, adv, mask)]
        ctx = ReductionContext.from_minibatch(views[3], group=None)
        a = select_cov_tokens(ctx, cfg, views[0], views[1], views[2], views[3], step=4)
        c = select_cov_tokens(ctx, cfg, copies[0], copies[1], copies[2], copies[3], step=4)
        assert _flat(a.selected).sum() > 1
        assert torch.equal(_flat(a.selected), _flat(c.selected)), cfg.policy_loss
        assert all(torch.equal(x, y) for x, y in zip((lp, old, adv, mask), before))


def test_fused_clip_cov_gradient_on_ties_outside_the_clip_bounds():
    """A ratio just outside a clip bound whose two PPO sides still round to the same loss: autograd
    halves the gradient there (``maximum``'s tie rule, the clamped side passing nothing). The
    fused backward must do the same."""
    from megatron_rl.loss import LossInputs
    from megatron_rl.loss.cov import clip_cov_token_loss

    hi = torch.tensor(1.2)
    above = torch.nextafter(hi, torch.tensor(2.0))
    old, logp, adv = [], [], []
    g = torch.Generator().manual_seed(13)
    while len(old) < 6:
        o = -torch.rand((), generator=g) * 2
        lp = o + torch.log(above.double()).float()
        for _ in range(4):  # nudge logp until exp(logp - old) is exactly the float above 1.2
            r = torch.exp(lp - o)
            if r == above:
                break
            lp = torch.nextafter(lp, lp + (1.0 if r < above else -1.0))
        if torch.exp(lp - o) != above:
            continue
        for a in torch.linspace(-1.99, -1.67, 400):
            if (-a) * above == (-a) * hi:  # the two sides tie although the ratio is clipped
                old.append(o), logp.append(lp), adv.append(a)
                break
    old, logp, adv = (torch.stack(x).view(1, -1) for x in (old, logp, adv))
    mask = torch.ones_like(old, dtype=torch.bool)
    sel = torch.zeros_like(mask)
    cfg = LossConfig(policy_loss="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.2)
    a = logp.clone().requires_grad_(True)
    clip_cov_token_loss(LossInputs(a, old, adv, mask, cov_selected=sel), cfg).loss.sum().backward()
    b = logp.clone().requires_grad_(True)
    r = torch.exp(b - old)
    torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)).sum().backward()
    assert (b.grad != 0).all() and _same_values(a.grad, b.grad)


def test_count_true_equals_the_bool_sum_on_both_kernels(monkeypatch):
    """``count_true`` / ``counts_f64`` equal the bool sum (all true, none, random, odd sizes and
    offsets, non-contiguous masks) through numpy (CPU) and through torch (other devices)."""
    from megatron_rl.loss import masking

    g = torch.Generator().manual_seed(14)
    base = torch.rand(3 * 8192 + 5, generator=g) < 0.4
    cases = [base[:16384], base[8:16392], base[3:16387], base[:8195], base[:100],
             torch.ones(8192, dtype=torch.bool), torch.zeros(8192, dtype=torch.bool),
             base[:16384].view(128, 128).t()]
    for torch_kernels in (False, True):
        if torch_kernels:
            monkeypatch.setattr(masking, "host_array", lambda x: None)
        for m in cases:
            assert int(masking.count_true(m)) == int(m.sum()), (m.shape, torch_kernels)
        counts = masking.counts_f64(*cases[:3])
        assert counts.dtype == torch.float64
        assert counts.tolist() == [float(m.sum()) for m in cases[:3]]


def test_global_index_of_candidate_positions_matches_the_full_index():
    """The multi-rank block top-k computes the global token index of its candidate positions
    only; it equals the full per-token index at those positions, for micro-batches of equal and
    of different lengths."""
    from megatron_rl.loss.cov import _global_index_at

    g = torch.Generator().manual_seed(15)
    for shapes in ([(3, 40), (2, 40), (4, 40)], [(3, 40), (2, 17), (4, 33)]):
        masks = [torch.ones(b, t, dtype=torch.bool) for b, t in shapes]
        ctx = ReductionContext.from_minibatch(masks, group=None)
        full = _flat(global_token_index(ctx, [m.shape for m in masks], torch.device("cpu")))
        pos = torch.randint(0, full.numel(), (200,), generator=g)
        assert torch.equal(_global_index_at(ctx, masks, pos), full[pos]), shapes


def test_in_place_finaliser_paths_equal_the_int64_reference():
    """``fmix32_i32_`` (numpy's uint32 arithmetic for contiguous CPU tensors, torch's int32 ops
    otherwise) gives the murmur3 finaliser's bits, with and without the premixed first step."""
    from megatron_rl.loss.select import _fmix32, _to_i32, _xorshift16, fmix32_i32_, unsigned_i64

    g = torch.Generator().manual_seed(16)
    x = torch.randint(-(2**31), 2**31 - 1, (64, 33), generator=g, dtype=torch.int64).to(torch.int32)
    want = _to_i32(_fmix32(unsigned_i64(x)))
    for premixed in (False, True):
        start = _xorshift16(x) if premixed else x
        contiguous = fmix32_i32_(start.clone(), torch.empty_like(x), premixed=premixed)
        h = torch.empty(64, 66, dtype=torch.int32)[:, ::2].copy_(start)  # not contiguous
        strided = fmix32_i32_(h, torch.empty_like(h), premixed=premixed)
        assert not h.is_contiguous()
        assert torch.equal(contiguous, want) and torch.equal(strided, want), premixed


def test_numpy_and_torch_kernels_give_the_same_selection_loss_and_gradient(monkeypatch):
    """On CPU the comparisons, bit-equality tests and counts run through numpy; elsewhere
    through torch. Forcing the torch kernels on CPU (as on an accelerator) changes no selected
    token, no loss bit, no gradient value and no metric."""
    from megatron_rl.loss import LossInputs, masking
    from megatron_rl.loss.cov import clip_cov_token_loss, kl_cov_token_loss

    logp0, old, adv, mask, sel, _, _ = _edge_inputs(4)
    g = torch.Generator().manual_seed(17)
    masks = [torch.arange(50)[None] < torch.randint(1, 51, (4, 1), generator=g) for _ in range(3)]
    lp = [-torch.rand(4, 50, generator=g) * 3 for _ in range(3)]
    olds = [x + torch.randn(4, 50, generator=g) * 0.3 for x in lp]
    advs = [torch.randn(4, 1, generator=g).expand(4, 50) for _ in range(3)]

    def run():
        out = []
        ctx = ReductionContext.from_minibatch(masks, group=None)
        for cfg in (LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-5.0),
                    LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.05)):
            s = select_cov_tokens(ctx, cfg, lp, olds, advs, masks, step=2)
            out.append((_flat(s.selected), {k: float(v) for k, v in s.stats.items()}))
        for fn in (clip_cov_token_loss, kl_cov_token_loss):
            a = logp0.clone().requires_grad_(True)
            tok = fn(LossInputs(a, old, adv, mask, cov_selected=sel),
                     LossConfig(policy_loss="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.2))
            tok.loss.sum().backward()
            out.append((tok.loss.detach().view(torch.int32), a.grad,
                        {k: (float(v.value), float(v.weight)) for k, v in tok.stats.items()}))
        return out

    fast = run()
    monkeypatch.setattr(masking, "host_array", lambda x: None)
    slow = run()
    for (s1, m1), (s2, m2) in zip(fast[:2], slow[:2]):
        assert s1.sum() > 0 and torch.equal(s1, s2) and m1 == pytest.approx(m2, rel=1e-12)
    for (l1, g1, m1), (l2, g2, m2) in zip(fast[2:], slow[2:]):
        assert torch.equal(l1, l2) and _same_values(g1, g2) and m1 == m2
