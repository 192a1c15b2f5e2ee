"""SIREN (megatron_rl/loss/siren.py): the peak-entropy selection against torch.nanquantile's
strict mask, hand-computed value and gradient of the self-anchored term, micro-batch invariance,
no host sync, config validation. DP=2 layouts: tests/test_loss_layout.py (case "siren")."""

from __future__ import annotations

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
                dict(siren_anchor=-0.5)):
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
