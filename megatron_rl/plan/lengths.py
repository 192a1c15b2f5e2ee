"""Response-length distributions and the price of padding: padded vs token-budget vs packed.

A distribution comes from a mean and a p95 (a log-normal through both, cut at the cap) or from a
histogram file a previous run wrote (``OUTPUT_DIR/response_lengths.json``, see
:func:`write_histogram`). :func:`padding_costs` prices the actor's per-step work three ways, from
the same sample of rows:

- ``padded``: every row padded to the step's longest (the cap: a step of hundreds of responses
  almost always has one at the cap), ``actor.max_tokens_per_micro_batch: 0``;
- ``token budget``: micro-batches cut by :func:`~megatron_rl.actor.micro_batches.
  token_budget_groups`, each padded to its own longest row;
- ``packed``: the rows' own tokens only (one THD row per micro-batch), attention per sequence.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

HISTOGRAM_FILE = "response_lengths.json"
HISTOGRAM_BINS = 64
_Z95 = 1.6448536269514722  # standard normal 95th percentile


class LengthsError(ValueError):
    """A length distribution input is invalid; the message names it."""


@dataclass(frozen=True)
class LengthSample:
    """Representative response lengths (tokens, each <= ``cap``) and where they came from."""

    lengths: tuple[int, ...]
    cap: int
    source: str

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)


def lognormal_sample(mean: float, p95: float, cap: int, n: int = 512) -> LengthSample:
    """``n`` quantiles of the log-normal with this ``mean`` and 95th percentile, cut at ``cap``
    (a p95 at the cap puts a tail of responses there)."""
    if not 0 < mean < p95:
        raise LengthsError(f"response length mean={mean} and p95={p95}: need 0 < mean < p95")
    if p95 > cap:
        raise LengthsError(f"response length p95={p95} exceeds the cap rollout.max_new_tokens="
                           f"{cap}")
    disc = _Z95 ** 2 - 2 * math.log(p95 / mean)
    if disc < 0:
        raise LengthsError(f"p95={p95} is too far above mean={mean} for a log-normal")
    sigma = _Z95 - math.sqrt(disc)
    mu = math.log(mean) - sigma * sigma / 2
    nd = NormalDist()
    out = [min(cap, max(1, round(math.exp(mu + sigma * nd.inv_cdf((i + 0.5) / n)))))
           for i in range(n)]
    return LengthSample(tuple(out), cap, f"log-normal, mean {mean:g}, p95 {p95:g}, cut at {cap}")


def histogram(lengths: Sequence[int], cap: int, bins: int = HISTOGRAM_BINS,
              counts: list[int] | None = None) -> dict:
    """Histogram of response lengths in ``bins`` equal bins over ``[0, cap]`` (added to
    ``counts`` when given)."""
    counts = list(counts) if counts is not None else [0] * bins
    for n in lengths:
        counts[min(bins - 1, int(n) * bins // max(cap, 1))] += 1
    return {"cap": int(cap), "bins": bins, "counts": counts}


def write_histogram(output_dir: str, lengths: Sequence[int], cap: int) -> str:
    """Add this step's response ``lengths`` to ``output_dir/response_lengths.json`` (atomic)."""
    path = os.path.join(output_dir, HISTOGRAM_FILE)
    prev = None
    if os.path.exists(path):
        with open(path) as f:
            prev = json.load(f)
        if prev.get("cap") != cap or prev.get("bins") != HISTOGRAM_BINS:
            prev = None  # a different cap: start again
    data = histogram(lengths, cap, counts=None if prev is None else prev["counts"])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


def read_histogram(path: str, n: int = 512) -> LengthSample:
    """A :class:`LengthSample` of ``n`` rows from a histogram file (bin midpoints, in
    proportion to the counts)."""
    try:
        with open(path) as f:
            data = json.load(f)
        cap, counts = int(data["cap"]), [int(c) for c in data["counts"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LengthsError(f"--lengths-file {path}: not a response-length histogram ({exc})") \
            from exc
    total = sum(counts)
    if not total:
        raise LengthsError(f"--lengths-file {path}: the histogram is empty")
    bins = len(counts)
    out: list[int] = []
    for b, c in enumerate(counts):
        out += [max(1, min(cap, round((b + 0.5) * cap / bins)))] * round(n * c / total)
    return LengthSample(tuple(out or [cap]), cap, f"histogram {path} ({total} responses)")


@dataclass(frozen=True)
class PaddingCost:
    """Per-row averages of one way of batching: tokens processed (with padding), the sum of
    squared lengths attention sees, and the pad fraction."""

    mode: str
    tokens: float  # processed tokens per row
    attn: float  # attention length^2 per row (causal work ~ L^2 per sequence)
    pad_fraction: float


def padding_costs(sample: LengthSample, prompt_len: int, budget: int) -> list[PaddingCost]:
    """Padded, token-budget and packed costs per row for ``sample`` with ``prompt_len``
    prompts; ``budget``: tokens per micro-batch of the token-budget mode."""
    from megatron_rl.actor.micro_batches import token_budget_groups

    rows = [prompt_len + n for n in sample.lengths]
    k = len(rows)
    real = sum(rows) / k
    full = prompt_len + sample.cap
    budget = max(budget, full)
    groups = token_budget_groups(rows, budget)
    longest = [max(rows[i] for i in g) for g in groups]
    tok_budget = sum(len(g) * m for g, m in zip(groups, longest)) / k
    attn_budget = sum(len(g) * m * m for g, m in zip(groups, longest)) / k
    return [PaddingCost("padded", full, full * full, 1 - real / full),
            PaddingCost("token budget", tok_budget, attn_budget, 1 - real / tok_budget),
            PaddingCost("packed", real, sum(r * r for r in rows) / k, 0.0)]
