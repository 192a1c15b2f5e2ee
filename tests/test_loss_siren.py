"""SIREN (megatron_rl/loss/siren.py): the peak-entropy selection against torch.nanquantile's
strict mask, hand-computed value and gradient of the self-anchored term, micro-batch invariance,
no host sync, config validation. DP=2 layouts: tests/test_loss_layout.py (case "siren")."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_rl.loss import LossConfig, LossConfigError, LossInputs, ReductionContext, compute_loss
from megatron_rl.loss.siren import SirenTerm, selection_size, siren_select

ENT = torch.tensor([[0.5, 2.0, 1.0, 0.1], [3.0, 0.7, 1.5, 9.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)  # 9.0 is padding


def _ctx(masks):
    return ReductionContext.from_minibatch(masks, group=None)


def test_siren_selection_size_matches_quantile_rule():
    for n in range(0, 40):
        for q in (0.5, 0.8, 0.95):
            x = torch.arange(n, dtype=torch.float64)  # distinct values
            want = int((x > torch.quantile(x, q)).sum()) if n else 0
            assert int(selection_size(torch.tensor(n), q)) == want, (n, q)


@pytest.mark.parametrize("seed", range(4))
def test_siren_selection_is_nanquantile_strict_mask_over_the_batch(seed):
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(6, 7, generator=g) * 3
    mask = torch.arange(7)[None, :] < torch.randint(0, 8, (6, 1), generator=g)
    cfg = LossConfig(siren_coef=0.1, siren_quantile=0.8).validate()
    got = siren_select(_ctx(mask), cfg, ent, mask)
    thr = torch.nanquantile(ent.masked_fill(~mask, float("nan")).reshape(-1), 0.8)
    want = mask & (ent > thr)
    assert torch.equal(got.selected[0], want)
    torch.testing.assert_close(got.h_sel, ent[want].double().mean())


def test_siren_hand_computed_value_and_gradient():
    """7 valid entropies 0.5 2 1 0.1 3 0.7 1.5: |S| = 7 - 1 - floor(0.8 * 6) = 2 -> {3.0, 2.0},
    H_S = 2.5; anchor 1.0: L = c (2.5 - 1)^2 = 2.25 c, dL/dH_t = 2 c 1.5 / 2 = 1.5 c on S."""
    cfg = LossConfig(policy_loss="ppo", siren_coef=0.2, siren_quantile=0.8).validate()
    ctx = _ctx(MASK)
    sel = siren_select(ctx, cfg, ENT, MASK)
    assert torch.equal(sel.selected[0], torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]]).bool())
    assert float(sel.h_sel) == 2.5 and float(sel.n_sel) == 2
    gap = sel.h_sel - 1.0
    h = ENT.clone().requires_grad_(True)
    z = torch.zeros(2, 4)
    inp = LossInputs(z.clone().requires_grad_(True), z, z, MASK, entropy=h,
                     siren=SirenTerm(sel.selected[0], gap, sel.n_sel))
    out = compute_loss(inp, cfg, ctx)  # the policy part is 0 (A = 0)
    out.loss.backward()
    assert float(out.loss) == pytest.approx(0.2 * 2.25)
    torch.testing.assert_close(h.grad, sel.selected[0].float() * 1.5 * 0.2)


def test_siren_micro_batch_split_gives_same_selection_value_and_gradient():
    g = torch.Generator().manual_seed(5)
    ent = torch.rand(8, 6, generator=g) * 2
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 0, 5, 6, 1, 3, 4])[:, None]
    cfg = LossConfig(siren_coef=0.5).validate()

    def run(parts):
        ctx = _ctx([mask[p] for p in parts])
        sel = siren_select(ctx, cfg, [ent[p] for p in parts], [mask[p] for p in parts])
        h = ent.clone().requires_grad_(True)
        z = torch.zeros(8, 6)
        total = torch.zeros(())
        for i, p in enumerate(parts):
            term = SirenTerm(sel.selected[i], sel.h_sel - 0.3, sel.n_sel)
            inp = LossInputs(z[p].clone().requires_grad_(True), z[p], z[p], mask[p],
                             entropy=h[p], siren=term)
            out = compute_loss(inp, cfg, ctx)
            out.loss.backward()
            total = total + out.loss.detach()
        return torch.cat(sel.selected), total, h.grad

    one = run([slice(0, 8)])
    four = run([slice(0, 3), slice(3, 4), slice(4, 7), slice(7, 8)])
    assert torch.equal(one[0], four[0]) and one[0].sum() >= 2
    torch.testing.assert_close(one[1], four[1])
    torch.testing.assert_close(one[2], four[2])
    # negative control: a per-micro-batch quantile (the reference's scope) selects other tokens
    local = torch.cat([siren_select(_ctx(mask[p]), cfg, ent[p], mask[p]).selected[0]
                       for p in (slice(0, 1), slice(1, 8))])
    assert not torch.equal(local, one[0])


def test_siren_runs_without_host_sync():
    from megatron_rl.testing.device_spy import CountHostSyncs

    cfg = LossConfig(siren_coef=0.2).validate()
    ctx = _ctx(MASK)
    z = torch.zeros(2, 4)
    with CountHostSyncs() as syncs:
        sel = siren_select(ctx, cfg, ENT, MASK)
        inp = LossInputs(z.clone().requires_grad_(True), z, z, MASK, entropy=ENT,
                         siren=SirenTerm(sel.selected[0], sel.h_sel - 1.0, sel.n_sel))
        compute_loss(inp, cfg, ctx)
    assert syncs.n == 0


def test_siren_config_validation_and_missing_inputs():
    for bad in (dict(siren_coef=-1.0), dict(siren_quantile=1.0), dict(siren_quantile=0.0),
                dict(siren_anchor=-0.5), dict(siren_coef=0.1, siren_top_p=0.0),
                dict(siren_coef=0.1, siren_top_p=1.5), dict(siren_top_p=0.8)):
        with pytest.raises(LossConfigError, match="siren_"):
            LossConfig(**bad).validate()
    cfg = LossConfig.for_algorithm("siren")
    assert cfg.siren_coef == 0.005 and cfg.clip_ratio_high == 0.28
    z = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="siren"):
        compute_loss(LossInputs(z, z, z, MASK, entropy=ENT), cfg, _ctx(MASK))


@pytest.mark.gpu
def test_siren_on_cuda_matches_cpu_without_host_sync():
    from megatron_rl.testing.device_spy import CountHostSyncs

    cfg = LossConfig(siren_coef=0.2).validate()
    res = []
    for device in ("cpu", "cuda"):
        ent, mask = ENT.clone().to(device).requires_grad_(True), MASK.to(device)
        z = torch.zeros(2, 4, device=device)
        ctx = _ctx(mask)
        with CountHostSyncs() as syncs:
            sel = siren_select(ctx, cfg, ent, mask)
            inp = LossInputs(z.clone().requires_grad_(True), z, z, mask, entropy=ent,
                             siren=SirenTerm(sel.selected[0], sel.h_sel - 1.0, sel.n_sel))
            out = compute_loss(inp, cfg, ctx)
            out.loss.backward()
        assert syncs.n == 0 and sel.h_sel.device.type == device
        res.append((sel.selected[0].cpu(), out.loss.detach().cpu(), ent.grad.cpu()))
    for a, b in zip(*res):
        torch.testing.assert_close(b, a)


SIREN_RESUME = ("parallel.tp=1", "parallel.pp=2", "sft.steps=3", "trainer.total_steps=3",
                "trainer.save_freq=1", "trainer.test_freq=3", "trainer.plots=false",
                "rollout.dynamic_sampling=false", "data.val_size=8")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_siren_anchor_survives_resume(tmp_path):
    """SIREN's anchor (the first step's selected entropy, held by the last pipeline stage) is
    saved with the checkpoint: a run resumed after step 1 logs the same metrics as the whole run
    (a re-anchored run would take step 2's entropy as its anchor)."""
    from test_trainer import ROOT, metrics, train_in_ranks

    config = os.path.join(ROOT, "examples", "tiny_siren.yaml")
    train_in_ranks(2, config, tmp_path, *SIREN_RESUME)
    full = metrics(tmp_path)
    assert len({r["siren/anchor"] for r in full if "siren/anchor" in r}) == 1
    (tmp_path / "checkpoints" / "latest").write_text("step_0000000")
    out = train_in_ranks(2, config, tmp_path, *SIREN_RESUME)
    assert "resumed from checkpoint at step 1" in out
    assert metrics(tmp_path) == full and len(full) == 4


# ---- the top-p vocabulary mask (megatron_rl/ops/top_p_entropy.py) -------------------------------
def authors_top_p_entropy(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The authors' efficient_top_p_sampling (Linn3a/siren@fa59a8d: verl/verl/workers/actor/
    dp_actor.py) re-implemented from its description, k = the whole vocabulary: sort, cumulative
    sum, keep the ranks before the first cumulative value >= p, renormalise, 1e-12 guards."""
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    cutoff = torch.searchsorted(cum, torch.full((cum.shape[0], 1), p, dtype=cum.dtype))
    keep_sorted = torch.arange(cum.shape[1]).unsqueeze(0) < cutoff
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    pd = probs * keep
    pd = pd / (pd.sum(-1, keepdim=True) + 1e-12)
    return -(pd * torch.log(pd + 1e-12)).sum(-1)


def test_siren_top_p_entropy_hand_vector():
    from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy

    # probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled vocabulary order
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]])).repeat(3, 1)
    h = [float(vocab_parallel_top_p_entropy(logits[:1], p)) for p in (0.85, 0.97, 0.4)]
    # 0.85: {0.5, 0.3} -> q = (0.625, 0.375); 0.97: {0.5, 0.3, 0.15} / 0.95; 0.4: nothing
    assert h[0] == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)), abs=1e-6)
    q = torch.tensor([0.5, 0.3, 0.15], dtype=torch.float64) / 0.95
    assert h[1] == pytest.approx(float(-(q * q.log()).sum()), abs=1e-6)
    assert h[2] == 0.0
    # temperature 2 flattens: p ~ sqrt(.) renormalised; compare with the authors' rule
    got = vocab_parallel_top_p_entropy(logits, 0.85, temperature=2.0)
    torch.testing.assert_close(got.double(), authors_top_p_entropy(logits / 2.0, 0.85),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("p", [0.3, 0.8, 0.95])
def test_siren_top_p_entropy_matches_authors_code_and_its_gradient(p):
    """Random logits (no ties): the nucleus entropy equals the authors' sort-based one; the
    gradient equals autograd through the masked softmax (mask from the authors' rule)."""
    from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 40, generator=g) * 2).requires_grad_(True)
    got = vocab_parallel_top_p_entropy(logits, p, chunk_size=24)
    want = authors_top_p_entropy(logits.detach(), p)
    assert (want > 0).any()
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    upstream = torch.randn(64, generator=g)
    (gl,) = torch.autograd.grad((got * upstream).sum(), logits)
    ref_logits = logits.detach().double().requires_grad_(True)
    probs = torch.softmax(ref_logits, -1)
    sorted_p, order = probs.detach().sort(-1, descending=True)
    cut = torch.searchsorted(sorted_p.cumsum(-1), torch.full((64, 1), p, dtype=torch.float64))
    keep = torch.zeros(64, 40, dtype=torch.bool).scatter(
        1, order, torch.arange(40).unsqueeze(0) < cut)
    logq = torch.log_softmax(ref_logits.masked_fill(~keep, -1e4), -1)
    h = -(torch.where(keep, logq.exp() * logq, 0.0)).sum(-1)
    h = torch.where(keep.any(-1), h, 0.0)
    (gr,) = torch.autograd.grad((h * upstream.double()).sum(), ref_logits)
    torch.testing.assert_close(gl.double(), gr, atol=1e-5, rtol=0)


def test_siren_top_p_entropy_without_host_sync():
    from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy
    from megatron_rl.testing.device_spy import CountHostSyncs

    logits = torch.randn(6, 16).requires_grad_(True)
    with CountHostSyncs() as syncs:
        h = vocab_parallel_top_p_entropy(logits, 0.8)
        h.sum().backward()
    assert syncs.n == 0


@pytest.mark.gpu
def test_siren_top_p_entropy_on_cuda_matches_cpu_without_host_sync():
    """The nucleus search on the device: same entropies and gradients as on the CPU, no host
    sync (fp32 and bf16 logits)."""
    from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy
    from megatron_rl.testing.device_spy import CountHostSyncs

    logits = torch.randn(256, 1000, generator=torch.Generator().manual_seed(0)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        res = []
        for device in ("cpu", "cuda"):
            x = logits.to(device=device, dtype=dtype).requires_grad_(True)
            with CountHostSyncs() as syncs:
                h = vocab_parallel_top_p_entropy(x, 0.8, chunk_size=100)
                h.sum().backward()
            assert syncs.n == 0 and h.device.type == device
            res.append((h.detach().cpu(), x.grad.float().cpu()))
        torch.testing.assert_close(res[1][0], res[0][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(res[1][1], res[0][1], atol=1e-4, rtol=1e-3)
