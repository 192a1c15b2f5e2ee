"""RAGEN-2 collapse diagnostics (``collapse/*``, :mod:`megatron_rl.metrics.collapse`): the
statistics match RAGEN's formulas on recorded log-probs, the X/Z partition, the cross-scoring rows
and their DP split, and the config checks. The run-level check (a tiny FrozenLake run logs them,
finite) rides on ``tests/test_frozenlake_ppo.py``'s REINFORCE++ run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.metrics.collapse import (
    Pair,
    collapse_statistics,
    cross_matrix,
    cross_rows,
    first_turn_pair,
    plan_pairs,
)


def ragen_reference(cross: np.ndarray, cross_sum: np.ndarray, col_ids: np.ndarray,
                    signatures: list[tuple]) -> dict[str, float]:
    """A direct re-implementation of RAGEN's CollapseDetector formulas (mll-lab-nu/RAGEN@18918cd:
    ragen/trainer/collapse_metrics.py) in numpy, on the recorded ``[NK, N]`` matrices."""
    nk, n = cross.shape

    def stats(mat):
        matched = mat[np.arange(nk), col_ids]
        mx = mat.max(axis=1, keepdims=True)
        marginal = (mx[:, 0] + np.log(np.exp(mat - mx).sum(axis=1))) - math.log(n)
        return matched, marginal

    out = {}
    for suffix, mat in (("", cross), ("_seq", cross_sum)):
        matched, marginal = stats(mat)
        std = marginal.std()  # unbiased=False
        out[f"collapse/mi_estimate{suffix}"] = matched.mean() - marginal.mean()
        out[f"collapse/conditional_entropy{suffix}"] = -matched.mean()
        out[f"collapse/reasoning_entropy{suffix}"] = -marginal.mean()
        out[f"collapse/marginal_std{suffix}"] = std
        out[f"collapse/mi_zscore{suffix}"] = ((matched - marginal) / (std + 1e-3)).mean()
    sig_ids: dict[tuple, int] = {}
    col_sig = np.array([sig_ids.setdefault(s, len(sig_ids)) for s in signatures])
    pred = cross.argmax(axis=1)
    out["collapse/retrieval_accuracy"] = (col_sig[pred] == col_sig[col_ids]).mean()
    counts = np.bincount(col_sig)
    out["collapse/retrieval_chance_level"] = float((counts[col_sig[col_ids]] / n).mean())
    out["collapse/mi_upper_bound"] = math.log(n)
    return out


def _stats(seq, lengths, cols, sig):
    return {k: float(v) for k, v in collapse_statistics(
        torch.tensor(seq, dtype=torch.float64), torch.tensor(lengths),
        torch.tensor(cols), torch.tensor(sig)).items()}


def test_collapse_statistics_hand_vector():
    # two samples, two inputs: L (summed over Z) with T = (1, 2); z_0 from x_0, z_1 from x_1
    got = _stats([[-1.0, -3.0], [-4.0, -2.0]], [1, 2], [0, 1], [0, 1])
    # per token l = [[-1, -3], [-2, -1]]: matched = (-1, -1)
    m0 = math.log((math.exp(-1) + math.exp(-3)) / 2)
    m1 = math.log((math.exp(-2) + math.exp(-1)) / 2)
    assert got["collapse/conditional_entropy"] == pytest.approx(1.0)
    assert got["collapse/reasoning_entropy"] == pytest.approx(-(m0 + m1) / 2)
    assert got["collapse/mi_estimate"] == pytest.approx(-1.0 - (m0 + m1) / 2)
    assert got["collapse/mi_estimate"] == pytest.approx(0.473052, abs=1e-6)
    s0 = math.log((math.exp(-1) + math.exp(-3)) / 2)
    s1 = math.log((math.exp(-4) + math.exp(-2)) / 2)
    assert got["collapse/mi_estimate_seq"] == pytest.approx(-1.5 - (s0 + s1) / 2)
    assert got["collapse/retrieval_accuracy"] == 1.0
    assert got["collapse/retrieval_chance_level"] == 0.5
    assert got["collapse/mi_upper_bound"] == pytest.approx(math.log(2))


def test_collapse_statistics_match_ragen_formulas_on_recorded_logprobs():
    """Recorded per-token log-probs of 12 samples x 4 inputs (two inputs share one X): our
    statistics equal RAGEN's formulas computed from the same numbers."""
    g = torch.Generator().manual_seed(7)
    m, n = 12, 4
    lengths = torch.randint(1, 6, (m,), generator=g)
    per_token = -torch.rand(m, n, int(lengths.max()), generator=g, dtype=torch.float64) * 3
    tok_mask = torch.arange(int(lengths.max())) < lengths.unsqueeze(1)
    seq = torch.where(tok_mask.unsqueeze(1), per_token, 0.0).sum(-1)  # [M, N]
    cols = torch.arange(m) % n
    sig = [0, 1, 2, 1]  # inputs 1 and 3 have the same X
    got = _stats(seq.tolist(), lengths.tolist(), cols.tolist(), sig)
    cross = (seq / lengths.unsqueeze(1)).numpy()
    want = ragen_reference(cross, seq.numpy(), cols.numpy(), [(0,), (1,), (2,), (1,)])
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got["collapse/retrieval_above_chance"] == pytest.approx(
        want["collapse/retrieval_accuracy"] - want["collapse/retrieval_chance_level"])


def test_collapse_input_independent_reasoning_has_zero_mi():
    """Template collapse: every input gives each z the same log-prob: I(X;Z) = 0 exactly and
    H(Z) = H(Z|X)."""
    seq = [[-2.0] * 3, [-5.0] * 3, [-1.0] * 3]
    got = _stats(seq, [2, 5, 1], [0, 1, 2], [0, 1, 2])
    assert got["collapse/mi_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert got["collapse/reasoning_entropy"] == pytest.approx(got["collapse/conditional_entropy"])


def _record(uid, prompt, reply, eos=0):
    return {"uid": uid, "prompt_ids": prompt, "response_ids": reply + [9, 9] + [7],
            "turn_ends": [len(reply) - 1, len(reply) + 2]}


def test_collapse_first_turn_partition_excludes_both_tags():
    """X = prompt + reply up to and including <think>; Z = what lies between the tags; the
    second turn is never Z."""
    open_ids, close_ids = [60, 116], [47, 116]
    rec = _record(5, [1, 2, 3], [33, 60, 116, 70, 71, 47, 116, 82, 0])
    p = first_turn_pair(rec, 0, "think", open_ids, close_ids)
    assert p == Pair(5, [1, 2, 3, 33, 60, 116], [70, 71])
    # no closing tag, or nothing between the tags: no reasoning
    assert first_turn_pair(_record(5, [1], [60, 116, 70, 0]), 0, "think", open_ids,
                           close_ids) is None
    assert first_turn_pair(_record(5, [1], [60, 116, 47, 116, 0]), 0, "think", open_ids,
                           close_ids) is None
    # reasoning: reply -> the whole first reply without its EOS
    assert first_turn_pair(rec, 0, "reply", [], []).z == [33, 60, 116, 70, 71, 47, 116, 82]


def test_collapse_cross_rows_score_every_z_under_every_x_and_split_over_dp():
    pairs = [Pair(1, [5, 6], [7]), None, Pair(1, [5, 6], [8, 9]), Pair(2, [4], [7]),
             Pair(3, [3, 3, 3], [6])]
    inputs, samples, plan = plan_pairs(pairs, max_inputs=2)  # uid 3 is past max_inputs
    assert inputs == [[5, 6], [4]] and plan.sample_input == [0, 0, 1]
    assert plan.lengths == [1, 2, 1] and plan.signature == [0, 1]
    assert (plan.replies, plan.valid) == (5, 4)
    batch = cross_rows(inputs, samples, pad_id=0, rows_multiple=4)
    assert batch["tokens"].shape == (8, 4)  # 6 rows + 2 padding rows, len(x)max + len(z)max
    assert batch["tokens"][3].tolist() == [4, 8, 9, 0]  # z_1 under x_1
    assert batch["mask"][3].tolist() == [False, True, True, False]
    assert batch["collapse_cell"].tolist() == [0, 1, 2, 3, 4, 5, 6, 6]
    # a fake "model": log p of a token = -token / 10 (-1 at padding, which the mask drops)
    logp = torch.where(batch["mask"], -batch["tokens"].double() / 10, -1.0)
    whole = cross_matrix(logp, batch, plan.shape)
    assert whole[1].tolist() == pytest.approx([-1.7, -1.7])
    # DP: each rank sums the cells of its rows; the all-reduce adds the partial matrices
    halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 8))]
    parts = [cross_matrix(logp[s], h, plan.shape)
             for s, h in zip((slice(0, 4), slice(4, 8)), halves)]
    assert torch.equal(parts[0] + parts[1], whole)


@pytest.mark.parametrize("override,match", [
    ("env.name=null", "collapse_metrics.enabled needs a multi-turn environment"),
    ("trainer.collapse_metrics.max_inputs=1", "max_inputs must be >= 2"),
    ("trainer.collapse_metrics.every_n_steps=0", "every_n_steps must be >= 1"),
    ("trainer.collapse_metrics.reasoning=all", "is not one of \\('think', 'reply'\\)"),
])
def test_collapse_config_errors_name_the_field(override, match):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.load import load_config

    with pytest.raises(ConfigError, match=match):
        load_config("examples/sweeps/tiny_frozenlake.yaml",
                    ["trainer.collapse_metrics.enabled=true", "trainer.advantage=grpo", override])
