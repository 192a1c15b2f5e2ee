"""Sampling filters over per-response records (plain Python, run on rank 0).

A *record* is a dict for one response; responses to the same prompt share ``record["uid"]``
(the *group*). Groups need not be contiguous or equally sized; group order is the order of first
appearance. Every function returns new lists/dicts and never mutates its input.

* :class:`DynamicSampler` / :func:`filter_groups_by_std` — DAPO dynamic sampling (ALGORITHMS.md
  §2.3, test vector D4).
* :func:`soft_overlong_penalty` / :func:`apply_overlong` — DAPO overlong handling (§2.4, D3).
* :func:`reward_variance_top_p` — RAGEN's reward-variance top-p filter with ``include_zero``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import numpy as np

ZERO_STD_EPS = 1e-10  # RAGEN's "zero score" threshold (|std| <= 1e-10 counts as zero)
# relative tolerance of the top-p mass comparison: the float64 running sum of exactly tied
# probabilities lands a few ulps below the exact mass (8 x 0.1 = 0.7999999999999999 < 0.8), which
# would keep one group more than exact arithmetic; 1e-9 is far above that rounding, far below any
# real gap between two cumulative masses
TOP_P_RTOL = 1e-9


class DynamicSamplingError(RuntimeError):
    """Raised when dynamic sampling needs more than ``max_num_gen_batches`` generation rounds."""


def group_records(records: Iterable[dict], uid_key: str = "uid") -> OrderedDict[Hashable, list]:
    """``uid -> [records]`` in order of first appearance."""
    groups: OrderedDict = OrderedDict()
    for r in records:
        groups.setdefault(r[uid_key], []).append(r)
    return groups


def bessel_std(values: Sequence[float]) -> float:
    """Sample standard deviation (ddof = 1); 0 for a group of one response."""
    if len(values) < 2:
        return 0.0
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1))


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling (§2.3)
# ----------------------------------------------------------------------------------------------
def filter_groups_by_std(records: Sequence[dict], metric: str = "acc", uid_key: str = "uid"
                         ) -> tuple[list[dict], dict]:
    """Keep the groups whose ``metric`` values have ``np.std > 0`` (population std, as verl) or
    that have exactly one response. Returns ``(kept records in input order, counts)`` with counts
    ``kept`` / ``dropped_all_correct`` / ``dropped_all_wrong`` in prompts. A dropped group is
    "all correct" when its common value is > 0 (acc 1, score +1), else "all wrong"."""
    groups = group_records(records, uid_key)
    keep_uids = set()
    counts = {"kept": 0, "dropped_all_correct": 0, "dropped_all_wrong": 0}
    for uid, rs in groups.items():
        try:
            vals = [float(r[metric]) for r in rs]
        except KeyError:
            raise KeyError(f"dynamic sampling: record of uid {uid!r} has no {metric!r} "
                           f"(filter metric); keys: {sorted(rs[0])}") from None
        if len(vals) == 1 or float(np.std(vals)) > 0:
            keep_uids.add(uid)
            counts["kept"] += 1
        elif vals[0] > 0:
            counts["dropped_all_correct"] += 1
        else:
            counts["dropped_all_wrong"] += 1
    kept = [r for r in records if r[uid_key] in keep_uids]
    return kept, counts


@dataclass
class DynamicSampler:
    """Accumulates generation batches until ``train_batch_size`` prompts have non-zero std.

    Usage per training step::

        sampler = DynamicSampler(train_batch_size=B, max_num_gen_batches=10)
        while not sampler.add(generate_and_score_one_batch()):   # raises after too many rounds
            pass
        records, stats = sampler.result()

    ``add`` returns True once at least ``train_batch_size`` prompts are kept. ``result`` truncates
    to the first ``train_batch_size`` kept prompts in concatenation order (equal to verl's first
    ``train_batch_size * n`` trajectories when groups are contiguous and of size ``n``).
    ``max_num_gen_batches <= 0`` means no limit. Uids must be unique across generation batches.
    """

    train_batch_size: int
    max_num_gen_batches: int = 10
    metric: str = "acc"
    uid_key: str = "uid"
    records: list = field(default_factory=list)
    num_gen_batches: int = 0
    num_prompts_generated: int = 0
    kept_prompts: int = 0
    dropped_all_correct: int = 0
    dropped_all_wrong: int = 0

    def add(self, batch_records: Sequence[dict]) -> bool:
        self.num_gen_batches += 1
        kept, c = filter_groups_by_std(batch_records, self.metric, self.uid_key)
        self.num_prompts_generated += len(group_records(batch_records, self.uid_key))
        self.records.extend(kept)
        self.kept_prompts += c["kept"]
        self.dropped_all_correct += c["dropped_all_correct"]
        self.dropped_all_wrong += c["dropped_all_wrong"]
        if self.kept_prompts >= self.train_batch_size:
            return True
        if self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches:
            raise DynamicSamplingError(
                f"dynamic sampling generated too many: {self.num_gen_batches} generation batches "
                f"(max_num_gen_batches={self.max_num_gen_batches}) kept only "
                f"{self.kept_prompts} < train_batch_size={self.train_batch_size} prompts with "
                f"non-zero {self.metric!r} std ({self.dropped_all_correct} all-correct and "
                f"{self.dropped_all_wrong} all-wrong prompts dropped). The task is too easy or "
                f"too hard for the policy; raise max_num_gen_batches or gen_batch_size."
            )
        return False

    @property
    def done(self) -> bool:
        return self.kept_prompts >= self.train_batch_size

    def result(self) -> tuple[list[dict], dict]:
        """``(records of the first train_batch_size kept prompts, stats)``; stats keys:
        ``kept`` (prompts returned), ``kept_total`` (before truncation), ``dropped_all_correct``,
        ``dropped_all_wrong``, ``num_gen_batches``, ``num_prompts_generated``."""
        groups = group_records(self.records, self.uid_key)
        keep = set(list(groups)[: self.train_batch_size])
        out = [r for r in self.records if r[self.uid_key] in keep]
        stats = {
            "kept": len(keep),
            "kept_total": self.kept_prompts,
            "dropped_all_correct": self.dropped_all_correct,
            "dropped_all_wrong": self.dropped_all_wrong,
            "num_gen_batches": self.num_gen_batches,
            "num_prompts_generated": self.num_prompts_generated,
        }
        return out, stats


# ----------------------------------------------------------------------------------------------
# Overlong handling (§2.4)
# ----------------------------------------------------------------------------------------------
def soft_overlong_penalty(length: int, max_len: int, cache_len: int,
                          penalty_factor: float = 1.0) -> float:
    """DAPO Eq. 13 scaled by ``penalty_factor`` (verl): 0 for ``length <= max_len - cache_len``;
    ``((max_len - cache_len) - length) / cache_len * penalty_factor`` up to ``max_len``; and the
    paper branch ``-penalty_factor`` (``-1``) beyond ``max_len``."""
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    expected = max_len - cache_len
    if length <= expected:
        return 0.0
    if length > max_len:
        return -float(penalty_factor)
    return (expected - length) / cache_len * penalty_factor


def apply_overlong(records: Sequence[dict], max_len: int, cache_len: int | None = None,
                   penalty_factor: float = 1.0, filter_truncated: bool = False,
                   length_key: str = "response_length", truncated_key: str = "truncated",
                   reward_key: str = "reward") -> tuple[list[dict], dict]:
    """Copies of ``records`` with overlong handling applied.

    * Soft punishment (``cache_len`` not None): ``overlong_reward`` is set and added to
      ``reward_key``.
    * Overlong filtering (``filter_truncated``): records with ``truncated_key`` true get
      ``overlong_filtered = True`` (the trainer zeroes their loss mask); others ``False``.

    Returns ``(records, metrics)`` with ``overlong_reward_mean``, ``overlong_frac`` (fraction with
    a non-zero penalty), ``truncated_frac`` and ``filtered`` (count)."""
    out, pens, n_trunc, n_filt = [], [], 0, 0
    for r in records:
        r = dict(r)
        trunc = bool(r.get(truncated_key, False))
        n_trunc += trunc
        if cache_len is not None:
            p = soft_overlong_penalty(int(r[length_key]), max_len, cache_len, penalty_factor)
            r["overlong_reward"] = p
            r[reward_key] = float(r.get(reward_key, 0.0)) + p
            pens.append(p)
        r["overlong_filtered"] = bool(filter_truncated and trunc)
        n_filt += r["overlong_filtered"]
        out.append(r)
    n = max(len(out), 1)
    metrics = {
        "overlong_reward_mean": float(np.mean(pens)) if pens else 0.0,
        "overlong_frac": (sum(p < 0 for p in pens) / n) if pens else 0.0,
        "truncated_frac": n_trunc / n,
        "filtered": n_filt,
    }
    return out, metrics


# ----------------------------------------------------------------------------------------------
# RAGEN reward-variance top-p
# ----------------------------------------------------------------------------------------------
def reward_variance_top_p(records: Sequence[dict], top_p: float, include_zero: bool = True,
                          reward_key: str = "reward", uid_key: str = "uid"
                          ) -> tuple[list, dict]:
    """RAGEN's ``top_p`` rollout filter (``rollout_filter_metric=reward_variance``,
    ``top_p_prob_mode=softmax``, ``filter_type=largest``).

    1. Per group: reward std with Bessel correction (a one-response group has std 0).
    2. ``include_zero=False``: groups with std <= 1e-10 leave the candidate set first.
    3. ``top_p >= 1``: keep every candidate.
    4. Otherwise probs = softmax(std) over the candidates (temperature 1, as RAGEN), sorted
       descending (ties: first appearance first); keep the smallest prefix whose cumulative mass
       is >= ``top_p`` up to a relative tolerance of ``TOP_P_RTOL`` (so exact ties keep what exact
       arithmetic keeps: 10 equal groups at ``top_p = 0.8`` keep 8); at least one group.

    Edge case: with ``include_zero=False`` and every group at zero std there are no candidates and
    the kept set is EMPTY (as RAGEN; its trainer skips such a step — nothing to learn from, the
    GRPO advantages are all zero). ``stats["empty_after_filter"]`` is then 1.

    Returns ``(kept uids in order of first appearance, stats)`` with stats ``num_groups``,
    ``kept``, ``kept_frac``, ``zero_std_groups``, ``empty_after_filter``, ``in_group_std_mean``,
    ``chosen_in_group_std_mean``. Use :func:`select_uids` to get the kept records.
    """
    if not 0.0 < top_p:
        raise ValueError(f"top_p must be > 0, got {top_p}")
    groups = group_records(records, uid_key)
    uids = list(groups)
    stds = [bessel_std([float(r[reward_key]) for r in groups[u]]) for u in uids]
    cand = [i for i in range(len(uids)) if include_zero or abs(stds[i]) > ZERO_STD_EPS]
    if not cand:
        chosen: list[int] = []
    elif top_p >= 1.0:
        chosen = cand
    else:
        x = np.array([stds[i] for i in cand], dtype=np.float64)
        e = np.exp(x - x.max())
        probs = e / e.sum()
        order = sorted(range(len(cand)), key=lambda j: -probs[j])  # stable: ties keep order
        cum, k = 0.0, len(cand)
        for pos, j in enumerate(order):
            cum += probs[j]
            if cum >= top_p * (1.0 - TOP_P_RTOL):
                k = pos + 1
                break
        chosen = sorted(cand[j] for j in order[:k])
    kept = [uids[i] for i in chosen]
    n = len(uids)
    stats = {
        "num_groups": n,
        "kept": len(kept),
        "kept_frac": len(kept) / n if n else 0.0,
        "zero_std_groups": sum(abs(s) <= ZERO_STD_EPS for s in stds),
        "empty_after_filter": int(n > 0 and not kept),
        "in_group_std_mean": float(np.mean(stds)) if stds else 0.0,
        "chosen_in_group_std_mean": float(np.mean([stds[i] for i in chosen])) if chosen else 0.0,
    }
    return kept, stats


def select_uids(records: Sequence[dict], uids: Iterable, uid_key: str = "uid") -> list[dict]:
    """The records whose uid is in ``uids``, in input order."""
    keep = set(uids)
    return [r for r in records if r[uid_key] in keep]


def mean_in_group_std(records: Sequence[dict], reward_key: str = "reward",
                      uid_key: str = "uid") -> float:
    """Mean over groups of the Bessel-corrected in-group reward std (early-stopping input)."""
    groups = group_records(records, uid_key)
    if not groups:
        return math.nan
    return float(np.mean([bessel_std([float(r[reward_key]) for r in rs])
                          for rs in groups.values()]))
