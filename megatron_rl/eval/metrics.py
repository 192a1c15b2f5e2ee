"""Per-set evaluation metrics from recorded samples (pure functions, no torch, no engine).

Every prompt of a set gets ``n`` samples; each sample has a correctness (its score is 1), an
extracted answer (``None``: nothing could be extracted), a length in tokens and whether it was
truncated at ``max_new_tokens``. For each ``k`` the user lists (``1 <= k <= n``):

* ``pass@k``: the unbiased estimator of Chen et al. 2021 (*Evaluating Large Language Models
  Trained on Code*), ``1 - C(n - c, k) / C(n, k)`` for a prompt with ``c`` correct samples of
  ``n``, in the numerically stable product form ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, averaged
  over prompts. It uses all ``n`` samples: it is the probability that at least one of ``k``
  samples drawn without replacement from the ``n`` is correct.
* ``avg@k``: the mean correctness of the first ``k`` samples of each prompt, averaged over
  prompts (what an evaluation with ``n = k`` samples reports; ``avg@n`` equals ``pass@1``).
* ``maj@k``: majority vote over the extracted answers of the first ``k`` samples of each prompt:
  the prompt counts as correct when the most frequent answer is a correct one. Samples without an
  extracted answer do not vote; a prompt none of whose ``k`` samples has an answer scores 0.
  **Ties**: when several answers share the highest count, the prompt scores the fraction of the
  tied answers that are correct (the expected result of breaking the tie uniformly at random), so
  the value does not depend on sample order. An answer is correct when its samples are (the mean
  correctness of the samples that gave it; the same answer always scores the same with a
  deterministic scorer).

``mean_length`` (tokens) and ``truncated_frac`` are over all samples of the set.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class Sample:
    """One scored response: ``correct`` (score == 1), the extracted ``answer`` (None: none),
    ``length`` in tokens, ``truncated`` (stopped at ``max_new_tokens``)."""

    correct: bool
    answer: Hashable | None = None
    length: int = 0
    truncated: bool = False


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples (``1 <= k <= n``):
    ``1 - C(n-c, k) / C(n, k)`` computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``."""
    _check_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct samples is not in [0, n={n}]")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(correct: Sequence[bool], k: int) -> float:
    """Mean correctness of the first ``k`` samples of one prompt."""
    _check_k(len(correct), k)
    return sum(bool(x) for x in correct[:k]) / k


def maj_at_k(samples: Sequence[Sample], k: int) -> float:
    """Majority-vote correctness of the first ``k`` samples of one prompt (ties: the fraction of
    the tied answers that are correct; no answer at all: 0; see the module docstring)."""
    _check_k(len(samples), k)
    voters = [s for s in samples[:k] if s.answer is not None]
    if not voters:
        return 0.0
    votes = Counter(s.answer for s in voters)
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    return sum(_answer_correct(voters, a) for a in tied) / len(tied)


def _answer_correct(samples: Sequence[Sample], answer: Hashable) -> float:
    """Mean correctness of the samples that gave ``answer``."""
    same = [s.correct for s in samples if s.answer == answer]
    return sum(same) / len(same)


def _check_k(n: int, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k={k!r} must be an integer in [1, n={n}] (n: samples per prompt)")


def set_metrics(groups: Sequence[Sequence[Sample]], ks: Sequence[int]) -> dict[str, float]:
    """``{"pass@k", "avg@k", "maj@k" for each k, "mean_length", "truncated_frac", "prompts",
    "samples"}`` of a set: ``groups[p]`` are prompt ``p``'s ``n`` samples in generation order
    (every prompt the same ``n``)."""
    if not groups:
        raise ValueError("set_metrics: no prompts")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"set_metrics: every prompt needs the same number of samples "
                         f"(got {sorted({len(g) for g in groups})})")
    out: dict[str, float] = {}
    for k in sorted(set(ks)):
        _check_k(n, k)
        out[f"pass@{k}"] = _mean(pass_at_k(n, sum(s.correct for s in g), k) for g in groups)
        out[f"avg@{k}"] = _mean(avg_at_k([s.correct for s in g], k) for g in groups)
        out[f"maj@{k}"] = _mean(maj_at_k(g, k) for g in groups)
    flat = [s for g in groups for s in g]
    out["mean_length"] = _mean(s.length for s in flat)
    out["truncated_frac"] = _mean(float(s.truncated) for s in flat)
    out["prompts"] = float(len(groups))
    out["samples"] = float(len(flat))
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)
