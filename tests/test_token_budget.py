"""Token-budget micro-batches (``actor.max_tokens_per_micro_batch``) and DP balancing by tokens.

Pure functions first (grouping, balancing, padding metrics, load-time check); then one spawn per
layout (TP1xPP1xDP1, TP1xPP2xDP1, TP1xPP1xDP2) that runs the same rows with and without a budget
for a token-level loss (DAPO), a sequence-level loss (GSPO) and Clip-Cov, plus the critic, and
checks that old log-probs, every all-reduced statistic, the loss and the updated weights agree
(fp32, gloo). The budget gives micro-batches of different shapes (variable P2P shapes with PP)
and, at DP2, a different micro-batch count per rank (filled with empty micro-batches).
"""

import pytest
import torch

from megatron_rl.actor.micro_batches import (
    TokenBudgetError,
    balance_over_dp,
    balanced_dp_rows,
    group_cost,
    padding_metrics,
    row_lengths,
    take_rows,
    token_budget_groups,
    unsplit_rows,
)
from megatron_rl.parallel.launch import spawn

SEQ, VOCAB, MINI, BUDGET = 24, 256, 4, 40
SPANS = [(3, 20), (2, 4), (5, 14), (1, 0), (4, 9), (2, 21), (3, 3), (6, 6)]  # (prompt, response)
LOSSES = ("dapo", "gspo", "clip_cov")


# ---- pure functions --------------------------------------------------------------------------
def test_groups_respect_budget_and_cover_rows():
    lengths = [23, 6, 19, 1, 13, 23, 6, 12, 2, 17]
    for budget in (23, 30, 40, 64, 1000):
        for packed in (False, True):
            groups = token_budget_groups(lengths, budget, packed=packed)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            assert all(group_cost([lengths[i] for i in g], packed) <= budget for g in groups)
            assert all(g == sorted(g) for g in groups)
    # padded cost: rows x the micro-batch's longest row, longest rows first
    assert token_budget_groups([5, 9, 4, 9], 18) == [[1, 3], [0, 2]]
    assert token_budget_groups([5, 9, 4, 9], 18, packed=True) == [[1, 3], [0, 2]]
    assert token_budget_groups([5, 9, 4, 9], 14, packed=True) == [[0, 1], [2, 3]]


def test_row_longer_than_budget_is_refused():
    with pytest.raises(TokenBudgetError, match=r"row 1 has 30 tokens.*=20"):
        token_budget_groups([3, 30, 4], 20)


def test_dp_balance_equal_rows_close_tokens():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5]
    parts = balance_over_dp(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) == 50  # the best equal-size split; contiguous: 280 vs 30
    rows = [balanced_dp_rows(lengths, 2, r, 4) for r in range(2)]
    assert sorted(torch.cat(rows).tolist()) == list(range(8))
    assert all(set(x.tolist()) & {0, 1, 2, 3} and len(x) == 4 for x in rows)  # per mini-batch
    with pytest.raises(ValueError, match="3 rows cannot be split evenly over 2"):
        balance_over_dp([1, 2, 3], 2)


def test_row_lengths_take_and_unsplit_round_trip():
    batch = make_batch()
    lengths = row_lengths(batch["mask"])
    assert lengths == [p + r if r else 1 for p, r in SPANS]
    groups = token_budget_groups(lengths, BUDGET)
    parts = [take_rows(batch, g, max(lengths[i] for i in g), SEQ) for g in groups]
    assert all(p["tokens"].shape[1] == max(lengths[i] for i in g) for p, g in zip(parts, groups))
    back = unsplit_rows([p["advantages"] for p in parts], groups, len(SPANS), SEQ)
    assert torch.equal(back, batch["advantages"])  # zero beyond each row's length
    m = padding_metrics(sum(lengths), sum(p["tokens"].numel() for p in parts), len(parts))
    padded = padding_metrics(sum(lengths), len(SPANS) * SEQ, 4)
    assert 0 <= m["actor/pad_fraction"] < padded["actor/pad_fraction"]


def test_budget_below_longest_sequence_is_a_load_error():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    over = ["actor.max_tokens_per_micro_batch=100", "data.max_prompt_length=64",
            "rollout.max_new_tokens=64"]
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=100.*64 \+ 64 = 128"):
        load_config(None, over)
    cfg = load_config(None, over[:1] + ["data.max_prompt_length=36", "rollout.max_new_tokens=64"])
    assert cfg.actor.max_tokens_per_micro_batch == 100
    with pytest.raises(ConfigError, match=r"1 prompt token \+ rollout.max_new_tokens = 101"):
        load_config(None, ["actor.max_tokens_per_micro_batch=100", "data.max_prompt_length=0",
                           "rollout.max_new_tokens=100"])


def test_clip_cov_selection_follows_rows_not_micro_batches():
    """One process: Clip-Cov picks the same tokens from token-budget micro-batches (rows
    regrouped and cut short, ``seq_ids`` = their global indices) as from row-count ones."""
    from megatron_rl.loss import ReductionContext, select_cov_tokens

    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    batch["logp"] = -torch.rand(len(SPANS), SEQ, generator=g) * batch["mask"]
    batch["old_logp"] = batch["logp"] + 0.05 * torch.randn(len(SPANS), SEQ, generator=g)
    cfg = loss_config("clip_cov")
    lengths = row_lengths(batch["mask"])
    groups = token_budget_groups(lengths, BUDGET)
    assert [i for grp in groups for i in grp] != list(range(len(SPANS)))  # rows do move
    plain = [take_rows(batch, range(i, i + 2), SEQ, SEQ) for i in range(0, len(SPANS), 2)]
    parts = [take_rows(batch, grp, max(lengths[i] for i in grp), SEQ) for grp in groups]

    def select(mbs, seq_ids=None):
        ctx = ReductionContext.from_minibatch([m["mask"] for m in mbs], group=None,
                                              seq_ids=seq_ids)
        sel = select_cov_tokens(ctx, cfg, [m["logp"] for m in mbs], [m["old_logp"] for m in mbs],
                                [m["advantages"] for m in mbs], [m["mask"] for m in mbs], step=3)
        return sel.selected

    want = torch.cat(select(plain))
    got = unsplit_rows(select(parts, [torch.tensor(grp) for grp in groups]), groups,
                       len(SPANS), SEQ)
    assert int(want.sum()) >= 2
    assert torch.equal(got, want)


# ---- invariance over layouts -----------------------------------------------------------------
def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(SPANS)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.zeros(n, SEQ, dtype=torch.bool)
    for b, (p, r) in enumerate(SPANS):
        mask[b, p:p + r] = True
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 0.8, -0.3, 0.2])[:, None].expand(n, SEQ)
    return {"tokens": tokens, "mask": mask, "advantages": (adv * mask).contiguous(),
            "old_noise": 0.3 * torch.randn(n, SEQ, generator=g),
            "token_rewards": torch.randn(n, SEQ, generator=g) * mask}


def loss_config(name: str):
    from megatron_rl.loss import LossConfig

    if name == "clip_cov":
        return LossConfig.for_algorithm("clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                                        clip_cov_ratio=0.05, clip_cov_lb=-100.0,
                                        clip_cov_ub=100.0, cov_stat_source="prepass")
    return LossConfig.for_algorithm(name)


def _gather_rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """This DP group's rows of ``t`` back in step order (last stage; None elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if t is None:
        return None
    parts: list = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(parts, (rows, t), group=ps.get_data_parallel_group())
    out = torch.zeros(len(SPANS), *t.shape[1:], dtype=t.dtype)
    for r, v in parts:
        out[r] = v
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _state_rel(a: dict, b: dict) -> float:
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    return diff / sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5


def _worker(tp: int, pp: int, dp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.config.sections import CriticSection
    from megatron_rl.critic.critic import Critic
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.weights import gather_full_state_dict
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.collect import dp_rows

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=120)
    full = make_batch()
    r = ps.get_data_parallel_rank()
    picks = {0: dp_rows(len(SPANS), dp, r, MINI),
             BUDGET: balanced_dp_rows(row_lengths(full["mask"]), dp, r, MINI)}
    report = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and r == 0
    out: dict = {}

    def local(budget: int) -> dict:
        batch = {k: v[picks[budget]] for k, v in full.items()}
        if budget:
            batch["row_index"] = picks[budget]
        return batch

    def cfg(budget: int) -> ActorConfig:
        return ActorConfig(micro_batch_size=MINI // dp // 2, mini_batch_size=MINI,
                           max_tokens_per_micro_batch=budget)

    for loss in LOSSES:
        res = {}
        for budget in (0, BUDGET):
            batch = local(budget)
            noise = batch.pop("old_noise")
            actor = Actor(get_preset("tiny"), cfg(budget),
                          OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0), loss_config(loss),
                          total_steps=1, seed=7)
            actor.add_old_logprobs(batch)
            old = _gather_rows(batch.get("old_logp"), picks[budget]) \
                if ps.is_pipeline_last_stage() else None
            if "old_logp" in batch:  # pretend the rollout policy lagged a little
                batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
            res[budget] = (actor.update(batch, 0), gather_full_state_dict(actor.model), old)
            del actor
        if report:
            out[loss] = {"hist": (res[0][0], res[BUDGET][0]),
                         "old_rel": _rel(res[BUDGET][2], res[0][2])}
        if dist.get_rank() == 0:
            out.setdefault(loss, {})["state_rel"] = _state_rel(res[BUDGET][1], res[0][1])
    crit = {}
    for budget in (0, BUDGET):  # critic: values pass, GAE, one value-loss update
        batch = local(budget)
        critic = Critic(get_preset("tiny"), CriticSection(lr=1e-3), cfg(budget), total_steps=1,
                        seed=7)
        critic.add_advantages(batch)
        crit[budget] = (critic.update(batch, 0, []), gather_full_state_dict(critic.model))
    if report:
        out["critic"] = {"hist": (crit[0][0], crit[BUDGET][0])}
    if dist.get_rank() == 0:
        out.setdefault("critic", {})["state_rel"] = _state_rel(crit[BUDGET][1], crit[0][1])
    runtime.shutdown()
    return out


def _run(tp: int, pp: int, dp: int) -> dict:
    merged: dict = {}
    for res in spawn(_worker, tp * pp * dp, (tp, pp, dp), timeout_s=400):
        for k, v in (res or {}).items():
            merged.setdefault(k, {}).update(v)
    return merged


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_token_budget_is_invariant(tp, pp, dp):
    """Same rows with and without a token budget (DP2: also balanced over ranks, with an empty
    micro-batch on the lighter rank): old log-probs, metrics, loss and weights agree."""
    if dp == 2:  # the layout exercises unequal micro-batch counts over DP
        lengths = row_lengths(make_batch()["mask"])
        counts = [[len(token_budget_groups([lengths[s + i] for i in part], BUDGET))
                   for part in balance_over_dp(lengths[s:s + MINI], 2)]
                  for s in range(0, len(SPANS), MINI)]
        assert any(a != b for a, b in counts)
    got = _run(tp, pp, dp)
    for loss in LOSSES:
        plain, budget = got[loss]["hist"]
        assert len(plain) == len(budget) == 2  # two mini-batches
        assert got[loss]["old_rel"] < 1e-5, loss
        assert got[loss]["state_rel"] < 1e-5, loss
        for a, b in zip(plain, budget):
            assert a["actor/skipped"] == b["actor/skipped"] == 0.0
            assert b["actor/pad_fraction"] < a["actor/pad_fraction"]
            assert b["actor/tokens_per_micro_batch"] <= BUDGET
            for k, v in a.items():
                if k not in ("actor/pad_fraction", "actor/tokens_per_micro_batch"):
                    assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (loss, k)
            assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-6, abs=1e-6)
    assert got["clip_cov"]["hist"][0][0]["clip_cov/num_selected"] >= 1
    plain, budget = got["critic"]["hist"]
    for k, v in plain[-1].items():
        assert budget[-1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert got["critic"]["state_rel"] < 1e-5


# ---- forward-only passes with experts: one micro-batch count over DP -------------------------
MOE_LENGTHS, MOE_SEQ, MOE_BUDGET = [9, 1, 5, 5], 12, 10  # DP2 rows [9, 1] | [5, 5]: 2 vs 1


def moe_budget_batch() -> dict:
    """Four rows whose forward lengths are :data:`MOE_LENGTHS` (row 1 has no response token)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (len(MOE_LENGTHS), MOE_SEQ), generator=g)
    mask = torch.zeros(len(MOE_LENGTHS), MOE_SEQ, dtype=torch.bool)
    for b, (start, length) in enumerate(zip([3, 0, 2, 1], MOE_LENGTHS)):
        mask[b, start:length] = length > 1
    return {"tokens": tokens, "mask": mask,
            "token_rewards": torch.randn(len(MOE_LENGTHS), MOE_SEQ, generator=g) * mask}


def _moe_forward_worker() -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.config.sections import CriticSection
    from megatron_rl.critic.critic import Critic
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=2, ep=2, timeout_s=60)  # a stuck collective raises
    r = ps.get_data_parallel_rank()
    batch = {k: v[2 * r:2 * r + 2] for k, v in moe_budget_batch().items()}
    model = get_preset("tiny-qwen3-moe")
    out: dict = {}
    for budget in (0, MOE_BUDGET):
        cfg = ActorConfig(micro_batch_size=1, mini_batch_size=4,
                          max_tokens_per_micro_batch=budget)
        actor = Actor(model, cfg, OptimConfig(lr=1e-3), loss_config("dapo"), total_steps=1,
                      seed=7)
        logp = actor.logprobs(batch)
        critic = Critic(model, CriticSection(lr=1e-3), cfg, total_steps=1, seed=7)
        with torch.no_grad():  # the head starts at zero: make the values say something
            w = critic.model.value_head.weight
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)))
        out[budget] = {"logp": logp["logp"], "entropy": logp["entropy"],
                       "values": critic.values(batch)}
        del actor, critic
    runtime.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_forward_budget_with_experts_agrees_micro_batch_count():
    """Old/reference log-probs and critic values with a token budget at DP2 x EP2: the ranks
    cut 2 and 1 micro-batches, but every forward is an all-to-all over both, so they must run
    the same count (the lighter rank adds a filler). A mismatch hangs or fails the gloo
    collectives (caught by their 60 s timeout or the launcher's); outputs equal the plain pass."""
    per_rank = [MOE_LENGTHS[:2], MOE_LENGTHS[2:]]
    assert [len(token_budget_groups(x, MOE_BUDGET)) for x in per_rank] == [2, 1]
    assert row_lengths(moe_budget_batch()["mask"]) == MOE_LENGTHS
    for res in spawn(_moe_forward_worker, 2, (), timeout_s=300):
        plain, budget = res[0], res[MOE_BUDGET]
        for k in ("logp", "entropy", "values"):
            assert budget[k].shape == plain[k].shape == (2, MOE_SEQ), k
            assert plain[k].abs().sum() > 0, k
            torch.testing.assert_close(budget[k], plain[k], rtol=1e-5, atol=1e-5, msg=k)
