"""Context parallelism (``parallel.cp``): layout, exact CP attention, CP1 vs CP2 invariance.

Single-process tests check the load-balanced split, the token budget's per-rank count and the
load-time errors. One spawned 2-rank gloo job runs the same actor (same weights, same global
batch of right-padded rows whose length 22 is not a multiple of 2 x CP, so the CP path pads)
at DP2xCP1 and at DP1xCP2, for DAPO + Clip-Cov (padded and packed rows) and GSPO (with the fused
log-prob/entropy head), and compares: the old pass's
log-probs and entropies, the Clip-Cov token selection, the update metrics (loss and
statistics) and the reduced gradients, and the critic's values, GAE advantages, value-loss
metrics and gradients; a 4-rank job does the same at PP2 (DAPO + Clip-Cov).
(DP2 vs one process is covered by the DP layout tests; both layouts use the same ranks.)

fp32 slack: CP attention computes each query row's scores against the same keys as CP 1 but in a
``[S/CP, S]`` GEMM instead of ``[S, S]`` and the gradient of K/V arrives as a sum over CP ranks,
so summation orders differ in the last bits. Measured on this batch: log-probs and entropies
(values 4-9) within 4.8e-7 absolute padded, 2.9e-6 packed (asserted: 1e-6 + 1e-6 x |value|),
loss and metrics within 2e-7 relative padded (asserted: 1e-6), 1.3e-6 packed (Clip-Cov's
``cov/mean_selected``, a mean of products of those log-probs; asserted: 1e-5), gradients 3e-7
relative L2 padded (asserted: 1e-6) and 1.3e-6 packed (asserted: 2e-6; each weight gradient is
summed over half the tokens per CP rank, then over the ranks); the selected token sets are
identical.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.micro_batches import TokenBudgetError, rank_tokens, token_budget_groups
from megatron_rl.parallel.backend import ParallelConfigError
from megatron_rl.parallel.context_parallel import (
    gathered_order,
    local_positions,
    padded_length,
    split_rows,
)
from megatron_rl.parallel.launch import spawn
from megatron_rl.parallel.runtime import validate_layout

SEQS, SEQ, VOCAB = 4, 22, 256
PADDING_METRICS = ("actor/pad_fraction", "actor/tokens_per_micro_batch")


# ---- single process ----------------------------------------------------------------------------
def test_load_balanced_split():
    """Rank r holds chunks r and 2CP-1-r of the row padded to a multiple of 2CP; the ranks
    together hold every position once, and the gather order puts them back in place."""
    assert padded_length(22, 2) == 24 and padded_length(22, 1) == 22
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (2, 4):
        held = torch.cat([local_positions(8 * cp, cp, r) for r in range(cp)])
        assert torch.equal(held[gathered_order(8, cp)], torch.arange(8 * cp))
    row = torch.arange(22).view(1, 22)
    parts = [split_rows(row, 2, r, fill=-1) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 4, 5, 18, 19, 20, 21, -1, -1]]
    assert parts[1].tolist() == [[6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def test_token_budget_counts_tokens_per_rank_after_the_split():
    """verl#3415: a budget counts each rank's tokens after the CP split (rows padded to 2CP),
    not the rows' tokens; at CP2 a micro-batch carries about twice the row tokens of CP1."""
    assert (rank_tokens(22, 1), rank_tokens(22, 2), rank_tokens(24, 4)) == (22, 12, 6)
    assert rank_tokens(25, 4) == 8  # 25 -> 32 padded, 8 per rank
    lengths = [22, 22, 22, 22]
    assert token_budget_groups(lengths, 48) == [[0, 1], [2, 3]]  # 2 rows x 22 <= 48
    assert token_budget_groups(lengths, 48, cp=2) == [[0, 1, 2, 3]]  # 4 rows x 12 per rank
    assert token_budget_groups(lengths, 24, cp=2) == [[0, 1], [2, 3]]
    with pytest.raises(TokenBudgetError, match="12 per rank at parallel.cp=2"):
        token_budget_groups(lengths, 11, cp=2)


def test_layout_errors_name_the_fields():
    assert validate_layout(8, 2, 1, None, cp=2) == 2
    with pytest.raises(ParallelConfigError, match=r"context_parallel_size \(2\) x "
                                                  r"data_parallel_size \(2\) = 16"):
        validate_layout(8, 2, 2, 2, cp=2)
    with pytest.raises(ParallelConfigError, match="context_parallel_size must be a positive"):
        validate_layout(2, 1, 1, None, cp=0)
    with pytest.raises(ParallelConfigError, match=r"not divisible .* context_parallel_size"):
        validate_layout(6, 1, 1, None, cp=4)


@pytest.mark.parametrize("overrides,match", [
    (["parallel.cp=3"], r"max_position_embeddings \(512\) is not a multiple of 2 x "
                        r"parallel.cp = 6"),
    (["parallel.cp=2", "actor.routing_replay=r2", "model.preset=tiny-qwen3-moe"],
     "parallel.cp=2 is not supported with actor.routing_replay"),
    (["parallel.cp=0"], "parallel.cp"),
])
def test_config_refuses_impossible_cp_layouts(overrides, match):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
    cfg = load_config(None, ["parallel.cp=2", "actor.pack_sequences=true"])  # accepted
    assert cfg.parallel.cp == 2


def _attention(heads: int = 8, groups: int = 2, d: int = 16):
    """An :class:`SDPAttention` of one layer (TP 1) without parallel_state."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=d, attention_dropout=0.0,
                            use_cpu_initialization=True)
    one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=one)


def _cp_attention_matches_causal(device: str, dtype: torch.dtype, sdpa: bool, atol: float):
    """Each CP rank's rows of :meth:`SDPAttention.global_causal` (its queries against the whole
    row's keys, mask on global positions) equal the unsplit causal attention's rows, forward and
    gradients (summed over ranks, as the K/V gather's reduce-scatter does)."""
    attn = _attention()
    attn.use_sdpa_on_cpu = sdpa
    g = torch.Generator().manual_seed(0)
    s, b, d = 24, 2, 16
    q0, k0, v0 = (torch.randn(s, b, n, d, generator=g).to(device, dtype) for n in (8, 2, 2))
    w = torch.randn(s, b, 8 * d, generator=g).to(device, dtype)
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    ref = attn(q, k, v, None)
    (ref.float() * w.float()).sum().backward()
    for cp in (2, 4):
        grads = [torch.zeros_like(x, dtype=torch.float32) for x in (q0, k0, v0)]
        for r in range(cp):
            pos = local_positions(s, cp, r, device)
            ql, kf, vf = (x.clone().requires_grad_() for x in (q0[pos], k0, v0))
            out = attn.global_causal(ql, kf, vf, pos)
            torch.testing.assert_close(out.float(), ref[pos].float(), atol=atol, rtol=0)
            (out.float() * w[pos].float()).sum().backward()
            grads[0][pos] += ql.grad.float()
            grads[1] += kf.grad.float()
            grads[2] += vf.grad.float()
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want.float(), atol=10 * atol, rtol=0)


@pytest.mark.parametrize("sdpa", [False, True], ids=["megatron_order", "sdpa_kernel"])
def test_cp_attention_rows_equal_causal_attention(sdpa):
    _cp_attention_matches_causal("cpu", torch.float32, sdpa, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp_attention_rows_equal_causal_attention_cuda(dtype):
    """The CUDA path (SDPA with the global-position mask) on one GPU: fp32 1e-5, bf16 2e-2
    (bf16 outputs; the unsplit reference runs is_causal kernels, the CP rows a masked one)."""
    _cp_attention_matches_causal("cuda", dtype, True, atol=1e-5 if dtype == torch.float32
                                 else 2e-2)


# ---- one 2-rank job: CP1 (DP2) vs CP2 (DP1) -----------------------------------------------------
def make_global_batch(seed: int = 0) -> dict:
    """Prompt + right-padded response rows (one ends at the last column), advantages, noise."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (SEQS, SEQ), generator=g)
    mask = torch.zeros(SEQS, SEQ, dtype=torch.bool)
    for b, (p, r) in enumerate([(3, 12), (5, 9), (2, 20), (6, 4)]):
        mask[b, p:p + r] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(SEQS, SEQ).contiguous()
    noise = 0.3 * torch.randn(SEQS, SEQ, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": adv * mask, "old_noise": noise}


def loss_configs() -> dict:
    from megatron_rl.loss import LossConfig

    return {
        # DAPO clip-higher + Clip-Cov (first update: statistics from the old pass)
        "dapo_clip_cov": LossConfig.for_algorithm(
            "clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=0.1,
            clip_cov_lb=-100.0, clip_cov_ub=100.0, cov_stat_source="prepass"),
        "gspo": LossConfig.for_algorithm("gspo", clip_ratio_low=0.05, clip_ratio_high=0.05,
                                         loss_agg_mode="seq-mean-token-mean"),
    }


def _run_layout(dp: int, cp: int, name: str, loss_cfg, tp: int = 1, pp: int = 1,
                pack: bool = False) -> dict:
    """One old pass + one update (one mini-batch, one row per micro-batch, so the micro-batches
    are the same rows at both layouts) at DP x CP; the whole batch's values."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.actor import train_step
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, cp=cp, timeout_s=120)
    full = make_global_batch()
    r = ps.get_data_parallel_rank()
    rows = slice(r * SEQS // dp, (r + 1) * SEQS // dp)
    batch = {k: v[rows].clone() for k, v in full.items()}
    noise = batch.pop("old_noise")
    actor = Actor(get_preset("tiny"),
                  ActorConfig(micro_batch_size=1, fused_logprob_entropy=name == "gspo",
                              pack_sequences=pack),
                  OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0), loss_cfg,
                  total_steps=1, seed=7)
    picked: list[torch.Tensor] = []
    orig = train_step.PolicyUpdater._cov_selection

    def record(self, mbs, ctx, *args, **kwargs):  # the selected tokens, as the loss gets them
        selected, stats = orig(self, mbs, ctx, *args, **kwargs)
        if selected is not None:
            picked.append(torch.cat([s.bool() for s in selected]))
        return selected, stats

    train_step.PolicyUpdater._cov_selection = record
    try:
        actor.add_old_logprobs(batch)
        if "old_logp" in batch:  # last stage
            batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
        history = actor.update(batch, 0)
    finally:
        train_step.PolicyUpdater._cov_selection = orig
    grads = torch.cat([p.main_grad.detach().flatten().double()
                       for p in actor.model.parameters()])
    last = ps.is_pipeline_last_stage()
    local = {"logp": batch["old_logp"] - noise * batch["mask"] if last else None,  # the pass's
             "entropy": batch.get("old_entropy"),
             "selected": torch.cat(picked) if picked else None}
    where = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), r,
             ps.get_context_parallel_rank())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (where, local, grads, history))
    table = {w: rest for w, *rest in every}
    tail = pp - 1  # rows of the whole batch: last stage, TP rank 0, one entry per DP rank
    out = {k: None if table[(tail, 0, 0, 0)][0][k] is None else
           torch.cat([table[(tail, 0, i, 0)][0][k] for i in range(dp)]) for k in local}
    out["cp_peers_agree"] = all(torch.equal(loc["logp"], table[(p, t, d, 0)][0]["logp"])
                                for (p, t, d, _c), (loc, _g, _h) in table.items() if p == tail)
    # the gradient of every weight: TP rank 0 of every stage (TP ranks hold slices)
    out["grads"] = torch.cat([table[(p, 0, 0, 0)][1] for p in range(pp)])
    out["history"] = table[(tail, 0, 0, 0)][2]
    return out


def _run_critic(dp: int, cp: int) -> dict:
    """The critic at DP x CP: values, GAE advantages and returns of the whole batch (turn
    rewards on each row's last response token), one update's metrics and reduced gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.config.sections import CriticSection
    from megatron_rl.critic.critic import Critic
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=dp, cp=cp, timeout_s=120)
    full = make_global_batch()
    last = (full["mask"] * torch.arange(1, SEQ + 1)).argmax(1)
    full["token_rewards"] = torch.zeros(SEQS, SEQ).index_put(
        (torch.arange(SEQS), last), torch.tensor([1.0, 0.0, 0.5, 1.0]))
    r = ps.get_data_parallel_rank()
    rows = slice(r * SEQS // dp, (r + 1) * SEQS // dp)
    batch = {k: full[k][rows].clone() for k in ("tokens", "mask", "token_rewards")}
    critic = Critic(get_preset("tiny"), CriticSection(lr=1e-2, gamma=0.95, lam=0.9,
                                                       cliprange_value=0.5),
                    ActorConfig(micro_batch_size=1, mini_batch_size=SEQS), 2, seed=5)
    batch = critic.add_advantages(batch)
    batch["values"] = batch["values"] + 0.1 * batch["mask"]  # a value loss with a gradient
    history = critic.update(batch, 0)
    local = {k: batch[k] for k in ("values", "returns", "advantages")}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (r, local))
    by_dp = dict(every)
    out = {k: torch.cat([by_dp[i][k] for i in range(dp)]) for k in local}
    out["history"] = history
    out["grads"] = torch.cat([p.main_grad.detach().flatten().double()
                              for p in critic.model.parameters()])
    return out


def _cp_worker(tp: int = 1, pp: int = 1, names: tuple[str, ...] | None = None,
               layouts: tuple = ((2, 1), (1, 2))) -> dict:
    """Each loss of ``names`` (all: None) at each ``(dp, cp)`` of ``layouts`` (CP 1 first)."""
    from megatron_rl.parallel import runtime

    results = {}
    for name, cfg in loss_configs().items():
        if names is None or name in names:
            results[name] = {(dp, cp): _run_layout(dp, cp, name, cfg, tp=tp, pp=pp)
                             for dp, cp in layouts}
    # packed rows: every segment padded to 2 x cp and split per segment
    if tp == pp == 1 and layouts == ((2, 1), (1, 2)):
        cfg = loss_configs()["dapo_clip_cov"]
        results["dapo_clip_cov_packed"] = {
            (dp, cp): _run_layout(dp, cp, "dapo_clip_cov", cfg, pack=True)
            for dp, cp in ((2, 1), (1, 2))}
        results["critic"] = {(dp, cp): _run_critic(dp, cp) for dp, cp in ((2, 1), (1, 2))}
    runtime.shutdown()
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp,names,layouts", [
    (1, 1, None, ((2, 1), (1, 2))),
    (1, 2, ("dapo_clip_cov",), ((2, 1), (1, 2))),
    (2, 1, ("dapo_clip_cov",), ((2, 1), (1, 2))),
    (1, 1, ("gspo",), ((4, 1), (2, 2))),
], ids=["tp1pp1", "pp2", "tp2", "dp2"])
def test_cp2_matches_cp1(tp, pp, names, layouts):
    """DP2xCP1 vs DP1xCP2 in one job (2 ranks; 4 with PP2: the pipeline's P2P shapes are the
    CP-split ones): log-probs, entropy, selected tokens, loss and metrics, gradients; at PP1 also
    the critic's values, GAE advantages, value-loss metrics and gradients (fp32 slack: see the
    module docstring)."""
    world = tp * pp * layouts[0][0]
    reports = spawn(_cp_worker, world, (tp, pp, names, layouts), timeout_s=360)
    for rank, res in enumerate(reports):
        critic = res.pop("critic", None)
        if critic is not None:  # values, GAE, the value loss's metrics and gradients
            a, b = critic[(2, 1)], critic[(1, 2)]
            for k in ("values", "returns", "advantages"):
                assert torch.allclose(b[k], a[k], atol=2e-6, rtol=0), (rank, k)
            ma, mb = a["history"][-1], b["history"][-1]
            assert any(k.startswith("critic/") for k in ma) and ma.keys() == mb.keys()
            for k in ma:
                assert mb[k] == pytest.approx(ma[k], rel=1e-6, abs=1e-7), (rank, "critic", k)
            assert float(a["grads"].norm()) > 0 and _rel(b["grads"], a["grads"]) <= 1e-6, rank
        for name, by_layout in res.items():
            a, b = by_layout[layouts[0]], by_layout[layouts[1]]
            assert b["cp_peers_agree"], (rank, name)
            assert torch.allclose(b["logp"], a["logp"], atol=1e-6, rtol=1e-6), (rank, name)
            assert torch.allclose(b["entropy"], a["entropy"], atol=1e-6, rtol=1e-6), (rank, name)
            if a["selected"] is not None:
                assert a["selected"].any(), name  # the bounds select something
                assert torch.equal(a["selected"], b["selected"]), (rank, name)
            assert len(a["history"]) == len(b["history"]) == 1
            for ma, mb in zip(a["history"], b["history"]):
                assert ma.keys() == mb.keys(), name
                for k in ma:
                    if name.endswith("_packed") and k in PADDING_METRICS:
                        continue  # CP pads every packed segment to 2 x cp: more processed tokens
                    rel = 1e-5 if name.endswith("_packed") else 1e-6  # docstring: fp32 slack
                    assert mb[k] == pytest.approx(ma[k], rel=rel, abs=1e-7), (rank, name, k)
            grad_tol = 2e-6 if name.endswith("_packed") else 1e-6  # docstring: fp32 slack
            assert _rel(b["grads"], a["grads"]) <= grad_tol, (rank, name)
