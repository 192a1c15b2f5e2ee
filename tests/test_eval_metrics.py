"""pass@k / avg@k / maj@k of :mod:`megatron_rl.eval.metrics` against brute force on recorded
samples, and the stated tie rule of maj@k."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_rl.eval.metrics import Sample, avg_at_k, maj_at_k, pass_at_k, set_metrics


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of all k-subsets of the recorded samples holding at least one correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def recorded_groups(seed: int = 0, prompts: int = 12, n: int = 8) -> list[list[bool]]:
    rng = random.Random(seed)
    return [[rng.random() < p for _ in range(n)] for p in
            [rng.choice([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]) for _ in range(prompts)]]


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_matches_brute_force_over_all_subsets(n):
    for correct in recorded_groups(seed=n, n=n):
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(correct), k) == pytest.approx(
                brute_pass_at_k(correct, k), abs=1e-12), (correct, k)


def test_pass_at_k_stable_for_large_n():
    """The product form stays finite where C(n, k) overflows a float."""
    v = pass_at_k(2000, 3, 1000)
    assert 0.8 < v < 1.0
    assert pass_at_k(2000, 0, 1000) == 0.0
    assert pass_at_k(2000, 1001, 1000) == 1.0
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)


def test_set_metrics_pass_at_k_is_mean_of_brute_force():
    groups = recorded_groups(seed=7, prompts=9, n=6)
    samples = [[Sample(c, str(c), 3, False) for c in g] for g in groups]
    m = set_metrics(samples, [1, 2, 6])
    for k in (1, 2, 6):
        want = sum(brute_pass_at_k(g, k) for g in groups) / len(groups)
        assert m[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert m["avg@6"] == pytest.approx(m["pass@1"])  # all n samples: the same estimate


def test_avg_at_k_uses_the_first_k_samples():
    assert avg_at_k([True, False, False, True], 2) == 0.5
    assert avg_at_k([True, False, False, True], 4) == 0.5
    assert avg_at_k([False, False, True, True], 2) == 0.0


def _s(answer, correct):
    return Sample(correct=correct, answer=answer)


def test_maj_at_k_majority_answer():
    group = [_s("4", True), _s("5", False), _s("4", True), _s("5", False), _s("5", False)]
    assert maj_at_k(group, 3) == 1.0  # "4" twice of 3
    assert maj_at_k(group, 5) == 0.0  # "5" three times of 5


def test_maj_at_k_ties_score_fraction_of_tied_answers_correct():
    """Stated rule: a tie scores the fraction of the tied answers that are correct, whatever the
    sample order."""
    tie = [_s("4", True), _s("5", False)]
    assert maj_at_k(tie, 2) == 0.5
    assert maj_at_k(list(reversed(tie)), 2) == 0.5
    three = [_s("a", False), _s("b", True), _s("c", True), _s("a", False), _s("b", True),
             _s("c", True)]
    assert maj_at_k(three, 6) == pytest.approx(2 / 3)
    both_wrong = [_s("x", False), _s("y", False)]
    assert maj_at_k(both_wrong, 2) == 0.0


def test_maj_at_k_samples_without_answer_do_not_vote():
    group = [_s(None, False), _s(None, False), _s("7", True)]
    assert maj_at_k(group, 3) == 1.0
    assert maj_at_k(group, 2) == 0.0  # nobody voted


def test_set_metrics_lengths_truncation_and_keys():
    groups = [[Sample(True, "1", 4, False), Sample(False, "2", 8, True)],
              [Sample(False, "3", 2, True), Sample(False, "3", 6, False)]]
    m = set_metrics(groups, [2, 1, 2])
    assert set(m) == {"pass@1", "avg@1", "maj@1", "pass@2", "avg@2", "maj@2", "mean_length",
                      "truncated_frac", "prompts", "samples"}
    assert m["mean_length"] == 5.0 and m["truncated_frac"] == 0.5
    assert m["pass@2"] == 0.5 and m["pass@1"] == 0.25 and m["avg@1"] == 0.5
    assert m["maj@2"] == 0.25  # prompt 0: tie "1"/"2" -> 0.5; prompt 1: "3" wrong -> 0


def test_bad_k_and_ragged_groups_are_errors():
    with pytest.raises(ValueError, match=r"k=3 must be an integer in \[1, n=2\]"):
        set_metrics([[Sample(True), Sample(False)]], [3])
    with pytest.raises(ValueError, match="same number of samples"):
        set_metrics([[Sample(True)], [Sample(True), Sample(False)]], [1])
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(4, 1, 0)
