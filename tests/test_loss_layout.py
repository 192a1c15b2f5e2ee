"""Layout invariance of every loss: DP=1x1, DP=2x1, DP=2x2 and DP=1x4 give the same loss, the same
gradients (w.r.t. logp and w.r.t. a shared parameter after DDP-style averaging), the same
Clip-Cov / KL-Cov token sets and the same metrics (atol 1e-6).

DP=2 layouts run in ONE spawned 2-process gloo job (all losses, both micro-batch splits, plus the
TP=2 ERC check); DP=1 layouts run in the test process. The negative controls show that an
anchor-style per-micro-batch normaliser / selection gives different results on the same split.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_rl.loss import (
    LossConfig,
    LossInputs,
    MetricAccumulator,
    ReductionContext,
    compute_loss,
    cov_stat_logp,
    entropy_dynamics_diagnostic,
    select_cov_tokens,
)
from megatron_rl.loss.bapo import bapo_bounds
from megatron_rl.loss.context import rank_token_bound
from megatron_rl.loss.rollout_correction import denominator_masks
from megatron_rl.loss.siren import SirenTerm, siren_select

B, T = 8, 12
ATOL = 1e-6
STEP = 7

CASES: dict[str, dict] = {
    "ppo_kl_entropy": dict(policy_loss="ppo", use_kl_loss=True, kl_loss_coef=0.1,
                           kl_loss_type="k3+", entropy_coeff=0.01),
    "dapo_seq_mean_token_mean": dict(policy_loss="dapo", clip_ratio_high=0.28,
                                     loss_agg_mode="seq-mean-token-mean"),
    "ppo_seq_mean_token_sum": dict(policy_loss="ppo", loss_agg_mode="seq-mean-token-sum"),
    "ppo_dr_grpo_norm": dict(policy_loss="ppo", loss_agg_mode="seq-mean-token-sum-norm",
                            loss_scale_factor=16.0),
    "ppo_verl_sum_norm": dict(policy_loss="ppo", loss_agg_mode="token-sum-norm",
                              loss_scale_factor=16.0),
    "gspo": dict(policy_loss="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05,
                 loss_agg_mode="seq-mean-token-mean"),
    "gspo_token": dict(policy_loss="gspo_token", clip_ratio_low=0.05, clip_ratio_high=0.05),
    "cispo": dict(policy_loss="cispo", clip_ratio_low=10.0, clip_ratio_high=0.2),
    "gppo_nll": dict(policy_loss="gppo", clip_ratio_c=10.0, positive_nll_coef=0.1),
    "aspo": dict(policy_loss="aspo", use_kl_loss=True, kl_loss_type="low_var_kl"),
    "clip_cov": dict(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.02,
                     clip_cov_ub=5.0),
    "clip_cov_old_logp": dict(policy_loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=0.02,
                              cov_stat_source="old_logp"),
    "kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=0.05, kl_cov_coef=1.0),
    "dcpo": dict(policy_loss="dcpo", clip_ratio_high=0.28, clip_ratio_c=10.0),
    "dapo_erc": dict(policy_loss="dapo", clip_ratio_high=0.28, clip_ratio_c=10.0, erc=True,
                     erc_low=0.9, erc_high=1.1),
    "gppo_erc": dict(policy_loss="gppo", clip_ratio_c=10.0, erc=True, erc_low=0.9, erc_high=1.1,
                     positive_nll_coef=0.1),
    # the 2025-26 losses, narrow bounds so that the tiny data hits them (test_new_losses_bite)
    "gmpo": dict(policy_loss="gmpo", gmpo_clip_low=0.1, gmpo_clip_high=0.1,
                 loss_agg_mode="seq-mean-token-mean"),
    "sapo_erc": dict(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=4.0, erc=True,
                     erc_low=0.9, erc_high=1.1),
    "dppo_tv_dr_grpo_norm": dict(policy_loss="dppo_tv", dppo_tv_delta_low=0.03,
                                 dppo_tv_delta_high=0.03, loss_agg_mode="seq-mean-token-sum-norm",
                                 loss_scale_factor=16.0),
    "dppo_kl_sq": dict(policy_loss="dppo_kl", dppo_kl_delta_low=0.003, dppo_kl_delta_high=0.003,
                       dppo_sq_log_ratio_coef=0.01, loss_agg_mode="seq-mean-token-mean"),
    # BAPO: bounds searched over the whole mini-batch (stops mid-search on this data)
    "bapo": dict(policy_loss="bapo", bapo_target=0.135, bapo_low_start=0.7, bapo_low_max=0.9,
                 bapo_high_start=1.05, bapo_high_max=1.5, bapo_high_step=0.02),
    # SIREN: peak-entropy tokens above the mini-batch's 0.6 quantile, anchored at 1.0
    "siren_dapo": dict(policy_loss="dapo", clip_ratio_high=0.28, siren_coef=0.5,
                       siren_quantile=0.6, siren_anchor=1.0),
    # off-policy correction (rollout_logp passed): bounds narrow enough that each one bites
    "ppo_rollout_none": dict(policy_loss="ppo", rollout_correction="none"),
    "ppo_tis_seq_mean": dict(policy_loss="ppo", rollout_correction="tis",
                             rollout_correction_threshold=1.3,
                             loss_agg_mode="seq-mean-token-mean"),
    "dapo_icepop": dict(policy_loss="dapo", clip_ratio_high=0.28, rollout_correction="icepop",
                        icepop_low=0.8, icepop_high=1.25),
    "ppo_mis_verl_sum_norm": dict(policy_loss="ppo", rollout_correction="mis",
                                  rollout_correction_threshold=1.3,
                                  loss_agg_mode="token-sum-norm", loss_scale_factor=16.0),
    "gmpo_seq_mask_tis": dict(policy_loss="gmpo", rollout_correction="seq_mask_tis",
                              rollout_correction_threshold=1.3, seq_mask_low=0.97,
                              seq_mask_high=1.03, loss_agg_mode="seq-mean-token-mean"),
    # rejected tokens out of the denominators (verl): global kept-token / kept-row counts
    "dapo_icepop_kept": dict(policy_loss="dapo", clip_ratio_high=0.28, rollout_correction="icepop",
                             icepop_low=0.8, icepop_high=1.25, use_kl_loss=True,
                             rollout_correction_denominator="kept"),
    "ppo_seq_mask_tis_kept": dict(policy_loss="ppo", rollout_correction="seq_mask_tis",
                                  rollout_correction_threshold=1.3, seq_mask_low=0.9,
                                  seq_mask_high=1.1, loss_agg_mode="seq-mean-token-mean",
                                  rollout_correction_denominator="kept"),
}


def make_data(seed: int = 0) -> dict[str, torch.Tensor]:
    """One global mini-batch [B, T]; values on a coarse grid so Cov has exact ties."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 3, 7, 0, 12, 5, 9, 1])  # one empty sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.randint(1, 9, (B, T), generator=g).float() / 4
    old = logp + (torch.randint(-4, 5, (B, T), generator=g).float() / 16)
    adv = (torch.randint(-2, 3, (B,), generator=g).float() / 2)[:, None].expand(B, T).clone()
    ent = torch.rand(B, T, generator=g) + 0.5
    old_ent = ent * (1 + (torch.rand(B, T, generator=g) - 0.5) * 0.4)
    ref = logp + torch.randn(B, T, generator=g) * 0.3
    feat = torch.randn(B, T, generator=g)
    positive = adv[:, 0] > 0
    rollout = old + torch.randint(-3, 4, (B, T), generator=g).float() / 8  # behaviour logp
    return dict(logp=logp, old=old, adv=adv, mask=mask, ent=ent, old_ent=old_ent, ref=ref,
                feat=feat, positive=positive, rollout=rollout)


def _trim(x: torch.Tensor, t: int) -> torch.Tensor:
    return x[:, :t] if x.dim() == 2 else x


def run_layout(case: str, data: dict, rows: slice, n_micro: int, group, trim: bool,
               overrides: dict | None = None) -> dict:
    """Run one case on this rank's ``rows`` split into ``n_micro`` micro-batches.

    Returns local loss sum, per-row grads (padded back to T), selected masks, w-grad, metrics.
    ``trim``: each micro-batch is cut to its own longest valid sequence (dynamic padding).
    """
    params = {**CASES[case], **(overrides or {})}
    cfg = LossConfig(**params).validate()
    local = {k: v[rows] for k, v in data.items()}
    n = local["mask"].shape[0]
    bounds = [(i * n // n_micro, (i + 1) * n // n_micro) for i in range(n_micro)]
    mbs = []
    for a, b in bounds:
        mb = {k: v[a:b] for k, v in local.items()}
        if trim:
            t_mb = max(int(mb["mask"].sum(-1).max()), 1)
            mb = {k: _trim(v, t_mb) for k, v in mb.items()}
        mbs.append(mb)
    masks = [mb["mask"] for mb in mbs]
    pos_masks = [mb["mask"] & mb["positive"][:, None] for mb in mbs]
    kept = denominator_masks([{"old_logp": mb["old"], "rollout_logp": mb["rollout"],
                               "mask": mb["mask"]} for mb in mbs], cfg)
    ctx = ReductionContext.from_minibatch(masks, group=group,
                                          extra_masks={"positive": pos_masks, **kept})
    w = torch.zeros((), requires_grad=True)  # a parameter shared (replicated) by all DP ranks
    sel_stats, selected = {}, [None] * n_micro
    if cfg.policy_loss in ("clip_cov", "kl_cov"):
        stat = cov_stat_logp(cfg, [mb["old"] for mb in mbs], [mb["logp"] for mb in mbs])
        sel = select_cov_tokens(ctx, cfg, stat, [mb["old"] for mb in mbs],
                                [mb["adv"] for mb in mbs], masks, step=STEP)
        sel_stats, selected = sel.stats, sel.selected
    bounds = None
    if cfg.policy_loss == "bapo":  # the current log-probs (the trainer's pre-pass)
        found = bapo_bounds(ctx, cfg, [mb["logp"] for mb in mbs], [mb["old"] for mb in mbs],
                            [mb["adv"] for mb in mbs], masks)
        bounds, sel_stats = found.bounds, found.stats
    siren = [None] * n_micro
    if cfg.siren_coef > 0:  # entropies of the current weights (the trainer's pre-pass)
        sirens = siren_select(ctx, cfg, [mb["ent"] for mb in mbs], masks)
        gap = sirens.h_sel - cfg.siren_anchor
        siren = [SirenTerm(s, gap, sirens.n_sel) for s in sirens.selected]
        selected = sirens.selected
        sel_stats = {"siren/selected_entropy": sirens.h_sel.float()}
    diag = entropy_dynamics_diagnostic(ctx, [mb["logp"] for mb in mbs], [mb["adv"] for mb in mbs],
                                       masks, top_frac=0.05)
    acc = MetricAccumulator()
    total, grads = torch.zeros(()), []
    for i, mb in enumerate(mbs):
        logp = mb["logp"] + w * mb["feat"]
        logp.retain_grad()
        # SIREN's gradient flows through the entropy: let it depend on the shared parameter too
        ent = mb["ent"] + w * mb["feat"] if siren[i] is not None else mb["ent"]
        inp = LossInputs(logp, mb["old"], mb["adv"], mb["mask"], entropy=ent,
                         old_entropy=mb["old_ent"], ref_logp=mb["ref"],
                         cov_selected=selected[i] if cfg.siren_coef == 0 else None,
                         siren=siren[i],
                         positive=mb["positive"],
                         rollout_logp=mb["rollout"] if "rollout_correction" in params
                         else None, bapo_bounds=bounds)
        out = compute_loss(inp, cfg, ctx)
        out.loss_for_backward.backward()
        acc.update(out.stats)
        total = total + out.loss.detach()
        grads.append(torch.nn.functional.pad(logp.grad / ctx.grad_scale, (0, T - logp.shape[1])))
    w_grad = w.grad.clone()
    if ctx.dp_size > 1:  # what megatron DDP does: average gradients over the DP group
        dist.all_reduce(w_grad, group=ctx.group)
        w_grad /= ctx.dp_size
    sel_rows = (torch.cat([torch.nn.functional.pad(s, (0, T - s.shape[1])) for s in selected])
                if selected[0] is not None else None)
    return dict(loss=total, grad=torch.cat(grads), selected=sel_rows, w_grad=w_grad,
                metrics={**acc.reduce(ctx), **sel_stats, **diag})


def _tp_erc_part(data: dict) -> dict:
    """TP=2: entropy from vocab-parallel shards -> ERC gate; returned for comparison with TP=1."""
    rank = dist.get_rank()
    logits, labels = data["tp_logits"], data["tp_labels"]
    v_local = logits.shape[-1] // 2
    shard = logits[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    return erc_from_logits(shard, labels, data, dist.group.WORLD)


def erc_from_logits(logits: torch.Tensor, labels: torch.Tensor, data: dict, tp_group) -> dict:
    from megatron_rl.ops.vocab_parallel import vocab_parallel_logprob_entropy

    logp, ent = vocab_parallel_logprob_entropy(logits, labels, group=tp_group)
    shape = data["mask"].shape
    logp, ent = logp.view(shape), ent.view(shape)
    cfg = LossConfig(policy_loss="dapo", clip_ratio_high=0.28, clip_ratio_c=10.0, erc=True,
                     erc_low=0.9, erc_high=1.1)
    ctx = ReductionContext.from_minibatch(data["mask"], group=None)  # DP = 1 here
    inp = LossInputs(logp, logp.detach() + data["old"] - data["logp"], data["adv"], data["mask"],
                     entropy=ent, old_entropy=data["tp_old_ent"])
    from megatron_rl.loss.erc import erc_keep_mask

    keep = erc_keep_mask(ent, data["tp_old_ent"], data["mask"], cfg.erc_low, cfg.erc_high)
    out = compute_loss(inp, cfg, ctx)
    out.loss.backward()
    return dict(entropy=ent.detach(), keep=keep, loss=out.loss.detach(), grad=logits.grad.clone())


TOP_P = (0.5, 0.8, 0.95)


def top_p_entropies(logits: torch.Tensor, tp_group) -> dict:
    """SIREN's nucleus entropy of ``logits`` (a vocab shard at TP=2) at each of :data:`TOP_P`
    and its gradient w.r.t. the logits (upstream: a fixed ramp)."""
    from megatron_rl.ops.top_p_entropy import vocab_parallel_top_p_entropy

    out = {}
    for p in TOP_P:
        x = logits.detach().clone().requires_grad_(True)
        h = vocab_parallel_top_p_entropy(x, p, tp_group, temperature=0.7, chunk_size=40)
        (h * torch.linspace(-1, 1, h.numel())).sum().backward()
        out[p] = (h.detach(), x.grad)
    return out


def _tp_top_p_part(data: dict) -> dict:
    """TP=2: the nucleus threshold searched over both vocabulary shards."""
    rank = dist.get_rank()
    v_local = data["tp_logits"].shape[-1] // 2
    return top_p_entropies(data["tp_logits"][:, rank * v_local:(rank + 1) * v_local],
                           dist.group.WORLD)


def dp2_worker(data: dict, tp_data: dict | None) -> dict:
    from megatron_rl.parallel.runtime import init_distributed

    init_distributed(backend="gloo", timeout_s=60)
    rank = dist.get_rank()
    rows = slice(rank * B // 2, (rank + 1) * B // 2)
    res = {}
    for n_micro, trim in ((1, False), (2, True)):
        for case in CASES:
            res[(case, n_micro)] = run_layout(case, data, rows, n_micro, "default", trim)
    if tp_data is not None:
        res["tp"] = _tp_erc_part(tp_data)
        res["tp_top_p"] = _tp_top_p_part(tp_data)
    res["radix"] = _radix_fallback_part(data, rows)
    res["collapse"] = collapse_part(dist.group.WORLD)
    return res


def collapse_part(group) -> dict:
    """RAGEN-2 collapse statistics from cross-scoring rows split over the DP ranks of ``group``
    (None: one process, every row): this rank's rows' log-probs, the ``[M, N]`` matrix summed
    over the group."""
    from megatron_rl.metrics.collapse import (
        Pair,
        collapse_statistics,
        cross_matrix,
        cross_rows,
        plan_pairs,
    )

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 50, (3 + j,), generator=g).tolist() for j in range(3)]
    pairs = [Pair(i // 3, prompts[i // 3], torch.randint(1, 50, (1 + i % 4,), generator=g).tolist())
             for i in range(9)]  # 3 inputs x 3 samples
    inputs, samples, plan = plan_pairs(pairs, max_inputs=8)
    batch = cross_rows(inputs, samples, 0, rows_multiple=4)  # 27 rows + 1 padding row
    logp = -torch.rand(batch["tokens"].shape, generator=g, dtype=torch.float64)
    if group is not None:  # contiguous DP blocks, as the trainer scatters them
        n = batch["tokens"].shape[0] // 2
        rows = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
        batch, logp = {k: v[rows] for k, v in batch.items()}, logp[rows]
    mat = cross_matrix(logp, batch, plan.shape, group)
    return collapse_statistics(mat, torch.tensor(plan.lengths), torch.tensor(plan.sample_input),
                               torch.tensor(plan.signature))


def _radix_fallback_part(data: dict, rows: slice) -> dict:
    """Clip-Cov / KL-Cov selections of this rank with the candidate exchange (the context knows
    the global padded size, as with gloo) and with the radix fallback (size unknown, as with
    device tensors): both exact, so the same tokens and counts."""
    out = {}
    local = {k: v[rows] for k, v in data.items()}
    mbs = [{k: v[:2] for k, v in local.items()}, {k: v[2:] for k, v in local.items()}]
    masks = [mb["mask"] for mb in mbs]
    for case in ("clip_cov", "kl_cov"):
        cfg = LossConfig(**CASES[case]).validate()
        picked = []
        for bound in ("known", None, "rank"):
            if bound == "rank":  # the trainer's bound (rows x max length): NCCL's code path
                rank_bound = rank_token_bound(masks, 2 * T)
                ctx = ReductionContext.from_minibatch(masks, group="default",
                                                      rank_numel_bound=rank_bound)
                assert ctx.numel_bound == 2 * rank_bound
            else:
                ctx = ReductionContext.from_minibatch(masks, group="default")
                assert ctx.numel_bound is not None
            if bound is None:
                ctx.numel_bound = None
            sel = select_cov_tokens(ctx, cfg, [mb["logp"] for mb in mbs],
                                    [mb["old"] for mb in mbs], [mb["adv"] for mb in mbs], masks,
                                    step=STEP)
            picked.append((torch.cat(sel.selected), sel.stats))
        out[case] = picked
    return out


def _vocab_parallel_available() -> bool:
    try:
        from megatron_rl.ops.vocab_parallel import vocab_parallel_logprob_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def _tp_data(data: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    out = dict(data)
    out["tp_logits"] = torch.randn(B * T, 16, generator=g) * 2
    out["tp_labels"] = torch.randint(0, 16, (B * T,), generator=g)
    # old entropy near the TP=1 entropy so that the gate keeps some tokens and drops others
    full = torch.log_softmax(out["tp_logits"], -1)
    h = -(full.exp() * full).sum(-1).view(B, T)
    out["tp_old_ent"] = h * (1 + (torch.rand(B, T, generator=g) - 0.5) * 0.4)
    return out


def compare(ref: dict, got: dict, label: str) -> None:
    torch.testing.assert_close(got["loss"], ref["loss"], atol=ATOL, rtol=0, msg=f"{label}: loss")
    torch.testing.assert_close(got["grad"], ref["grad"], atol=ATOL, rtol=0,
                               msg=f"{label}: grad logp")
    torch.testing.assert_close(got["w_grad"], ref["w_grad"], atol=ATOL, rtol=1e-6,
                               msg=f"{label}: DP-averaged grad of a shared parameter")
    if ref["selected"] is not None:
        assert torch.equal(got["selected"], ref["selected"]), f"{label}: selected token set"
    assert sorted(got["metrics"]) == sorted(ref["metrics"]), f"{label}: metric names"
    for k, v in ref["metrics"].items():
        torch.testing.assert_close(got["metrics"][k], v, atol=ATOL, rtol=1e-6,
                                   msg=f"{label}: metric {k}")


def merge_ranks(per_rank: list[dict]) -> dict:
    a, b = per_rank
    return dict(loss=a["loss"] + b["loss"], grad=torch.cat([a["grad"], b["grad"]]),
                selected=None if a["selected"] is None else torch.cat([a["selected"],
                                                                         b["selected"]]),
                w_grad=a["w_grad"], metrics=a["metrics"])


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def reference(data):
    return {case: run_layout(case, data, slice(0, B), 1, None, False) for case in CASES}


def test_dp1_four_micro_batches_match_one(data, reference):
    for case in CASES:
        compare(reference[case], run_layout(case, data, slice(0, B), 4, None, True),
                f"{case} DP=1x4")


def test_selection_is_nontrivial(reference):
    for case in ("clip_cov", "kl_cov", "clip_cov_old_logp"):
        n = int(reference[case]["selected"].sum())
        assert n >= 2, (case, n)
    assert 0 < float(reference["dapo_erc"]["metrics"]["erc/kept_frac"]) < 1


def test_new_losses_bite(reference):
    """The GMPO clip and the DPPO masks are active on part of the data, so the layout comparison
    covers their zero-gradient branches too; SAPO's soft gate is away from 1."""
    for case in ("gmpo", "dppo_tv_dr_grpo_norm", "dppo_kl_sq"):
        assert 0 < float(reference[case]["metrics"]["policy/clip_frac"]) < 0.5, case
    assert float(reference["sapo_erc"]["metrics"]["sapo/grad_weight_min"]) < 0.9


def test_bapo_search_bites_in_layout_data(reference):
    """BAPO's search stops strictly inside its grid and clips some tokens, so the layout
    comparisons cover a data-dependent choice of bounds."""
    m = reference["bapo"]["metrics"]
    assert 0 < float(m["bapo/search_steps"]) < 4 + 22, float(m["bapo/search_steps"])
    assert 0 < float(m["policy/clip_frac"]) < 1


def test_siren_selection_bites_in_layout_data(reference):
    """SIREN selects part of the tokens and its regulariser moves the shared parameter."""
    n_valid = int(make_data()["mask"].sum())
    n_sel = int(reference["siren_dapo"]["selected"].sum())
    assert 2 <= n_sel < n_valid
    assert float(reference["siren_dapo"]["metrics"]["siren/reg"]) > 0


def test_rollout_corrections_bite(reference):
    """Each correction truncates / masks part of the tokens (rows for seq_mask_tis), so the
    layout comparisons cover both sides of every bound and the global IS-weight metrics."""
    for case, key in (("ppo_tis_seq_mean", "clipped_frac"), ("dapo_icepop", "masked_frac"),
                      ("ppo_mis_verl_sum_norm", "masked_frac"),
                      ("gmpo_seq_mask_tis", "seq_masked_frac"),
                      ("gmpo_seq_mask_tis", "clipped_frac")):
        assert 0 < float(reference[case]["metrics"][f"rollout_corr/{key}"]) < 1, (case, key)
    m = reference["ppo_rollout_none"]["metrics"]
    assert float(m["rollout_corr/ratio_max"]) == pytest.approx(math.exp(3 / 8), rel=1e-6)
    assert "rollout_corr/weight_mean" not in m


def test_partial_denominator_kept_cases_differ_from_all(data, reference):
    """The ``kept`` layout cases reject tokens and so change the gradient against ``all``."""
    for case in ("dapo_icepop_kept", "ppo_seq_mask_tis_kept"):
        assert 0 < float(reference[case]["metrics"]["rollout_corr/masked_frac"]) < 1, case
        alt = run_layout(case, data, slice(0, B), 1, None, False,
                         {"rollout_correction_denominator": "all"})
        assert not torch.allclose(alt["loss"], reference[case]["loss"]), case
        assert not torch.allclose(alt["grad"], reference[case]["grad"]), case


@pytest.fixture(scope="module")
def dp2_results(data):
    """The one spawned 2-process job: ``(per-rank results, TP data or None)``."""
    from megatron_rl.parallel.launch import spawn

    tp_data = _tp_data(data) if _vocab_parallel_available() else None
    return spawn(dp2_worker, 2, (data, tp_data), timeout_s=240), tp_data


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_layouts_match_single_process(data, reference, dp2_results):
    results, tp_data = dp2_results
    with_tp = tp_data is not None
    for r in results:
        for case, ((sel_a, st_a), *others) in r["radix"].items():
            for sel_b, st_b in others:  # the radix fallback and the trainer's rank bound
                assert sel_a.any() and torch.equal(sel_a, sel_b), case
                for name in st_a:
                    torch.testing.assert_close(st_a[name], st_b[name], atol=ATOL, rtol=0)
    for case in CASES:
        for n_micro in (1, 2):
            got = merge_ranks([r[(case, n_micro)] for r in results])
            assert torch.equal(results[0][(case, n_micro)]["w_grad"],
                               results[1][(case, n_micro)]["w_grad"])
            compare(reference[case], got, f"{case} DP=2x{n_micro}")
    if with_tp:
        logits = tp_data["tp_logits"].clone().requires_grad_(True)
        ref = erc_from_logits(logits, tp_data["tp_labels"], tp_data, None)
        assert 0 < int(ref["keep"].sum()) < int(tp_data["mask"].sum())
        v_local = logits.shape[-1] // 2
        for rank, r in enumerate(results):
            tp = r["tp"]
            torch.testing.assert_close(tp["entropy"], ref["entropy"], atol=ATOL, rtol=0)
            assert torch.equal(tp["keep"], ref["keep"]), "ERC gate differs between TP=2 and TP=1"
            torch.testing.assert_close(tp["loss"], ref["loss"], atol=ATOL, rtol=0)
            torch.testing.assert_close(tp["grad"],
                                       ref["grad"][:, rank * v_local:(rank + 1) * v_local],
                                       atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_siren_top_p_entropy_tp2_matches_tp1(dp2_results):
    """SIREN's top-p vocabulary mask over two vocabulary shards (threshold searched with
    all-reduces over the TP group): the same nucleus entropies and logit gradients as over the
    whole vocabulary."""
    results, tp_data = dp2_results
    if tp_data is None:
        pytest.skip("vocab-parallel ops unavailable")
    ref = top_p_entropies(tp_data["tp_logits"], None)
    v_local = tp_data["tp_logits"].shape[-1] // 2
    for p in TOP_P:
        h, grad = ref[p]
        assert (h > 0).any() and (h == 0).any(), p  # empty and non-empty nuclei
        for rank, r in enumerate(results):
            got_h, got_g = r["tp_top_p"][p]
            torch.testing.assert_close(got_h, h, atol=ATOL, rtol=0)
            torch.testing.assert_close(got_g, grad[:, rank * v_local:(rank + 1) * v_local],
                                       atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collapse_statistics_dp2_match_single_process(dp2_results):
    """The collapse cross-scoring rows split over two DP ranks: the all-reduced matrix gives the
    single-process statistics on both ranks."""
    ref = collapse_part(None)
    assert ref["collapse/mi_estimate"] != 0
    for r in dp2_results[0]:
        assert sorted(r["collapse"]) == sorted(ref)
        for k, v in ref.items():
            torch.testing.assert_close(r["collapse"][k], v, atol=1e-12, rtol=1e-12, msg=k)


# ---- negative controls: the comparison above can fail --------------------------------------
def anchor_style_grad(case: str, data: dict, n_micro: int) -> torch.Tensor:
    """Per-micro-batch denominators and selection (what the anchors do), 1/n_micro accumulation."""
    cfg = LossConfig(**CASES[case]).validate()
    grads = []
    for i in range(n_micro):
        rows = slice(i * B // n_micro, (i + 1) * B // n_micro)
        mb = {k: v[rows] for k, v in data.items()}
        ctx = ReductionContext.from_minibatch(mb["mask"], group=None,
                                              extra_masks={"positive": [mb["mask"]]})
        sel = None
        if cfg.policy_loss in ("clip_cov", "kl_cov"):
            sel = select_cov_tokens(ctx, cfg, mb["logp"], mb["old"], mb["adv"], mb["mask"],
                                    step=STEP).selected[0]
        logp = mb["logp"].clone().requires_grad_(True)
        inp = LossInputs(logp, mb["old"], mb["adv"], mb["mask"], entropy=mb["ent"],
                         old_entropy=mb["old_ent"], ref_logp=mb["ref"], cov_selected=sel,
                         positive=mb["positive"])
        out = compute_loss(inp, cfg, ctx)
        (out.loss / n_micro).backward()
        grads.append(logp.grad)
    return torch.cat(grads)


@pytest.mark.parametrize("case", ["ppo_kl_entropy", "kl_cov", "clip_cov"])
def test_negative_control_per_micro_batch_normaliser_differs(data, reference, case):
    local = anchor_style_grad(case, data, 4)
    assert (local - reference[case]["grad"]).abs().max() > 1e-3


def test_negative_control_per_micro_batch_selection_differs(data, reference):
    cfg = LossConfig(**CASES["kl_cov"]).validate()
    picked = []
    for i in range(4):
        rows = slice(i * B // 4, (i + 1) * B // 4)
        ctx = ReductionContext.from_minibatch(data["mask"][rows], group=None)
        picked.append(select_cov_tokens(ctx, cfg, data["logp"][rows], data["old"][rows],
                                        data["adv"][rows], data["mask"][rows]).selected[0])
    assert not torch.equal(torch.cat(picked), reference["kl_cov"]["selected"])
