"""Response-length distributions and the price of padding: padded vs token-budget vs packed.

A distribution comes from a mean and a p95 (a log-normal through both, cut at the cap) or from a
histogram file a previous run wrote (``OUTPUT_DIR/response_lengths.json``, see
:mod:`megatron_rl.metrics.response_lengths`). :func:`padding_costs` prices the actor's per-step
work three ways, from the same sample of rows:

- ``padded``: every row padded to the step's longest (the cap: a step of hundreds of responses
  almost always has one at the cap), ``actor.max_tokens_per_micro_batch: 0``;
- ``token budget``: micro-batches cut by :func:`~megatron_rl.actor.micro_batches.
  token_budget_groups`, each padded to its own longest row;
- ``packed``: the rows' own tokens only (one THD row per micro-batch), attention per sequence.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from statistics import NormalDist

from megatron_rl.plan.inputs import PlanError, PlanInputs

ASSUMED_MEAN, ASSUMED_P95 = 0.3, 0.9  # fractions of the cap when no distribution is given
_Z95 = 1.6448536269514722  # standard normal 95th percentile


class LengthsError(PlanError):
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
    response_tokens: float  # scored response tokens per row (the output head's work)


def padding_costs(sample: LengthSample, prompt_len: int, budget: int, rows_per_rank: int = 0
                  ) -> list[PaddingCost]:
    """Padded, token-budget and packed costs per row for ``sample`` with ``prompt_len``
    prompts; ``budget``: tokens per micro-batch of the token-budget mode, whose micro-batches
    are cut from ``rows_per_rank`` rows at a time (one DP rank's mini-batch, rows in a seeded
    random order; 0: all rows at once)."""
    import random

    from megatron_rl.actor.micro_batches import token_budget_groups

    rows = [prompt_len + n for n in sample.lengths]
    random.Random(0).shuffle(rows)
    k = len(rows)
    real = sum(rows) / k
    full = prompt_len + sample.cap
    budget = max(budget, full)
    step = rows_per_rank if 0 < rows_per_rank < k else k
    tok_budget = attn_budget = 0.0
    for start in range(0, k, step):
        part = rows[start:start + step]
        for g in token_budget_groups(part, budget):
            m = max(part[i] for i in g)
            tok_budget += len(g) * m / k
            attn_budget += len(g) * m * m / k
    resp = sample.mean
    return [PaddingCost("padded", full, full * full, 1 - real / full, resp),
            PaddingCost("token budget", tok_budget, attn_budget, 1 - real / tok_budget, resp),
            PaddingCost("packed", real, sum(r * r for r in rows) / k, 0.0, resp)]


def sample_for(x: PlanInputs) -> LengthSample:
    """The response lengths a plan prices: ``x.lengths_file``, else ``x.response_mean`` /
    ``x.response_p95``, else an assumed long tail (mean 30 %, p95 90 % of the cap)."""
    cap = x.response_len
    if x.lengths_file:
        return read_histogram(x.lengths_file)
    if x.response_mean or x.response_p95:
        return lognormal_sample(x.response_mean, x.response_p95 or cap, cap)
    s = lognormal_sample(ASSUMED_MEAN * cap, ASSUMED_P95 * cap, cap)
    return LengthSample(s.lengths, cap, "assumed " + s.source + " (--response-mean/--response-"
                        "p95 or --lengths-file OUTPUT_DIR/response_lengths.json)")


def micro_batch_budget(x: PlanInputs) -> int:
    """Tokens per micro-batch of the token-budget mode: ``actor.max_tokens_per_micro_batch``,
    else today's micro-batch (``micro_batch_size x`` the padded length: the same memory)."""
    return x.token_budget or x.micro_batch_size * x.seq_len
