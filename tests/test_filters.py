"""Sampling filters: DAPO dynamic sampling (D4), overlong (D3), RAGEN reward-variance top-p."""

import math

import pytest

from megatron_rl.rollout.filters import (
    DynamicSampler,
    DynamicSamplingError,
    apply_overlong,
    bessel_std,
    filter_groups_by_std,
    mean_in_group_std,
    reward_variance_top_p,
    select_uids,
    soft_overlong_penalty,
)


def _group(uid, accs, rewards=None):
    rewards = rewards if rewards is not None else accs
    return [{"uid": uid, "acc": a, "reward": r, "i": k}
            for k, (a, r) in enumerate(zip(accs, rewards))]


def test_d4_dynamic_sampling():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=10, metric="acc")
    b1 = _group("P1", [1, 1, 1, 1]) + _group("P2", [0, 0, 0, 0]) + _group("P3", [1, 0, 0, 0])
    assert s.add(b1) is False
    assert s.kept_prompts == 1 and s.num_gen_batches == 1
    b2 = (_group("P4", [1, 1, 0, 1]) + _group("P5", [1, 1, 1, 1], [1, 1, 0.5, 1])
          + _group("P6", [0, 1, 0, 0]))
    assert s.add(b2) is True
    recs, st = s.result()
    assert len(recs) == 8  # train_batch_size * n
    assert [r["uid"] for r in recs] == ["P3"] * 4 + ["P4"] * 4
    assert st["num_gen_batches"] == 2
    assert st["kept"] == 2 and st["kept_total"] == 3
    assert st["dropped_all_correct"] == 2  # P1, P5 (P5 dropped although final rewards differ)
    assert st["dropped_all_wrong"] == 1  # P2
    assert st["num_prompts_generated"] == 6


def test_dynamic_sampling_too_many_and_singleton():
    s = DynamicSampler(train_batch_size=2, max_num_gen_batches=2)
    s.add(_group("a", [1, 1]))
    with pytest.raises(DynamicSamplingError, match="generated too many"):
        s.add(_group("b", [0, 0]))
    # A one-response group is kept; max_num_gen_batches <= 0 = unlimited.
    kept, c = filter_groups_by_std(_group("x", [1]) + _group("y", [0, 0]))
    assert [r["uid"] for r in kept] == ["x"] and c["dropped_all_wrong"] == 1
    s = DynamicSampler(train_batch_size=1, max_num_gen_batches=0)
    for k in range(20):
        assert not s.add(_group(f"u{k}", [1, 1]))
    with pytest.raises(KeyError, match="filter metric"):
        filter_groups_by_std([{"uid": 1}])


def test_d3_soft_overlong():
    got = [soft_overlong_penalty(n, 10, 4) for n in (5, 6, 7, 8, 10, 12)]
    assert got == pytest.approx([0, 0, -0.25, -0.5, -1.0, -1.0])
    assert soft_overlong_penalty(16384, 20480, 4096) == 0
    assert soft_overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert soft_overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)
    assert 1 + soft_overlong_penalty(8, 10, 4) == pytest.approx(0.5)
    assert soft_overlong_penalty(30, 10, 4, penalty_factor=0.5) == -0.5
    with pytest.raises(ValueError):
        soft_overlong_penalty(3, 10, 0)


def test_apply_overlong_and_filtering():
    recs = [{"uid": 0, "reward": 1.0, "response_length": 8, "truncated": False},
            {"uid": 0, "reward": -1.0, "response_length": 12, "truncated": True}]
    out, m = apply_overlong(recs, max_len=10, cache_len=4, filter_truncated=True)
    assert [r["reward"] for r in out] == pytest.approx([0.5, -2.0])
    assert [r["overlong_filtered"] for r in out] == [False, True]
    assert recs[0]["reward"] == 1.0  # input not mutated
    assert m["overlong_frac"] == 1.0 and m["truncated_frac"] == 0.5 and m["filtered"] == 1
    assert m["overlong_reward_mean"] == pytest.approx(-0.75)
    out, m = apply_overlong(recs, max_len=10, cache_len=None, filter_truncated=False)
    assert [r["reward"] for r in out] == [1.0, -1.0] and not any(
        r["overlong_filtered"] for r in out)


# Hand-computed table (groups interleaved, unequal sizes):
#   group  rewards      Bessel std               exp(std)
#   A      [1,0,1,0]    sqrt(1/3) = 0.57735      1.78131
#   B      [1,1,1,1]    0                         1
#   C      [1,0,0,0]    sqrt(0.75/3) = 0.5       1.64872
#   D      [2]          0 (single response)       1
#   E      [0,2]        sqrt(2) = 1.41421         4.11325
# include_zero=True: sum 9.54328 -> probs E .43101, A .18666, C .17276, B .10479, D .10479
#   cumulative (sorted): .43101, .61767, .79043, .89522, 1.0
# include_zero=False (A, C, E): sum 7.54328 -> E .54529, A .23615, C .21857
#   cumulative: .54529, .78144, 1.0
RV_TABLE = {"A": [1, 0, 1, 0], "B": [1, 1, 1, 1], "C": [1, 0, 0, 0], "D": [2], "E": [0, 2]}


def _rv_records():
    recs, k = [], 0
    while any(RV_TABLE.values()):
        for u, rs in RV_TABLE.items():  # round-robin: groups are not contiguous
            if k < len(rs):
                recs.append({"uid": u, "reward": rs[k]})
        k += 1
        if k > 4:
            break
    return recs


def test_rv_std_values():
    assert bessel_std([1, 0, 1, 0]) == pytest.approx(math.sqrt(1 / 3))
    assert bessel_std([1, 0, 0, 0]) == pytest.approx(0.5)
    assert bessel_std([2]) == 0.0
    assert mean_in_group_std(_rv_records()) == pytest.approx(
        (math.sqrt(1 / 3) + 0.5 + math.sqrt(2)) / 5)


@pytest.mark.parametrize("p,include_zero,expected", [
    (0.40, True, ["E"]),
    (0.50, True, ["A", "E"]),            # .43101 < .5 <= .61767
    (0.70, True, ["A", "C", "E"]),       # .61767 < .7 <= .79043
    (0.80, True, ["A", "B", "C", "E"]),  # tie B/D: first appearance (B) first
    (0.90, True, ["A", "B", "C", "D", "E"]),  # .89522 < .9
    (1.00, True, ["A", "B", "C", "D", "E"]),
    (0.50, False, ["E"]),                # .54529 >= .5
    (0.60, False, ["A", "E"]),           # .54529 < .6 <= .78144
    (0.80, False, ["A", "C", "E"]),
    (1.00, False, ["A", "C", "E"]),
    (0.01, False, ["E"]),                # at least one group
])
def test_rv_top_p_table(p, include_zero, expected):
    kept, st = reward_variance_top_p(_rv_records(), p, include_zero=include_zero)
    assert sorted(kept) == expected
    assert st["num_groups"] == 5 and st["kept"] == len(expected)
    assert st["zero_std_groups"] == 2 and st["empty_after_filter"] == 0
    recs = select_uids(_rv_records(), kept)
    assert {r["uid"] for r in recs} == set(expected)


def test_rv_top_p_all_zero():
    recs = [{"uid": u, "reward": 1.0} for u in "abc" for _ in range(2)]
    kept, st = reward_variance_top_p(recs, 0.9, include_zero=False)
    assert kept == [] and st["empty_after_filter"] == 1 and st["kept_frac"] == 0
    kept, st = reward_variance_top_p(recs, 0.5, include_zero=True)
    assert kept == ["a", "b"]  # uniform probs 1/3: mass 2/3 >= .5
    with pytest.raises(ValueError):
        reward_variance_top_p(recs, 0.0)


@pytest.mark.parametrize("n", [6, 7, 10, 20])
def test_rv_top_p_exact_ties_keep_what_exact_arithmetic_keeps(n):
    """Equal reward spreads: every group has probability 1/n, so top_p = k/n keeps exactly k
    groups. The float64 running sum lands a few ulps low (8 x 0.1 = 0.7999999999999999), which
    kept k + 1 before the relative tolerance."""
    recs = [{"uid": g, "reward": float(r)} for g in range(n) for r in (0, 1, 1)]
    for k in range(1, n + 1):
        kept, st = reward_variance_top_p(recs, k / n, include_zero=False)
        assert st["kept"] == k, (k, n, kept)
        assert kept == list(range(k))  # ties: first appearance first
