"""Globally reduced metrics, accumulated locally per micro-batch and reduced once per mini-batch.

A loss emits :class:`TokenStat` records; :class:`MetricAccumulator` keeps local sums (no host
sync) and :meth:`MetricAccumulator.reduce` all-reduces them with two collectives (one SUM for
every mean/sum, one MIN for every min and negated max). A mean is ``global sum(value * weight) /
global sum(weight)``, the mean over the whole mini-batch's valid tokens whatever the layout.
A metric with zero global weight (e.g. no valid token) reports 0.

Every rank must emit the same metric names (they do when they run the same config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.loss.context import ReductionContext
from megatron_rl.loss.masking import mask_bits, zero_where_not

Tensor = torch.Tensor
KINDS = ("mean", "min", "max", "sum")


@dataclass(frozen=True)
class TokenStat:
    """One metric contribution.

    ``mean``: ``value``/``weight`` are ``[B, T]`` (weight: mask of the tokens it averages over).
    ``min``/``max``: extremum of ``value`` over tokens with ``weight > 0``.
    ``sum``: ``value`` is 0-dim and summed over micro-batches and ranks (``weight`` unused).
    """

    value: Tensor
    weight: Tensor | None = None
    kind: str = "mean"


def as_float(x: Tensor) -> Tensor:
    """``x.float()``; a bool tensor goes through its uint8 view (same values, a much cheaper
    conversion on CPU)."""
    x = x.detach()
    return x.contiguous().view(torch.uint8).float() if x.dtype == torch.bool else x.float()


def mean_stat(value: Tensor, weight: Tensor) -> TokenStat:
    """Mean of ``value`` over ``weight``; bool values / weights stay bool (a mask needs no
    multiplication and its counts are exact integer sums, same results as their 0/1 floats)."""
    value, weight = value.detach(), weight.detach()
    return TokenStat(value if value.dtype == torch.bool else value.float(),
                     weight if weight.dtype == torch.bool else weight.float(), "mean")


class MetricAccumulator:
    """Local running sums of :class:`TokenStat` records of one mini-batch."""

    def __init__(self) -> None:
        self._num: dict[str, Tensor] = {}
        self._den: dict[str, Tensor] = {}
        self._min: dict[str, Tensor] = {}
        self._max: dict[str, Tensor] = {}
        self._sum: dict[str, Tensor] = {}

    def add(self, name: str, stat: TokenStat, _cache: dict | None = None) -> None:
        """Accumulate one record (sync-free)."""
        v = stat.value.detach()
        if stat.kind == "sum":
            self._sum[name] = self._sum.get(name, 0) + v.sum(dtype=torch.float64)
            return
        if (stat.kind == "mean" and stat.weight is not None and stat.weight.dtype == torch.bool
                and stat.weight.shape == v.shape):
            self._add_masked_mean(name, v, stat.weight, {} if _cache is None else _cache)
            return
        if v.dtype == torch.bool:
            v = as_float(v)
        w = stat.weight.detach() > 0 if stat.weight is not None else torch.ones_like(v, dtype=bool)
        if stat.kind == "mean":
            wf = stat.weight.detach().to(v.dtype)
            vw = v * wf
            num = (zero_where_not(vw, mask_bits(w, vw.dtype)) if vw.shape == w.shape
                   else torch.where(w, vw, 0.0)).sum(dtype=torch.float64)
            self._num[name] = self._num.get(name, 0) + num
            self._den[name] = self._den.get(name, 0) + wf.sum(dtype=torch.float64)
        elif stat.kind == "min":
            m = (torch.where(w, v, torch.inf).amin() if v.numel() else v.new_tensor(torch.inf))
            m = m.to(torch.float64)
            self._min[name] = torch.minimum(self._min[name], m) if name in self._min else m
        elif stat.kind == "max":
            m = (torch.where(w, v, -torch.inf).amax() if v.numel() else v.new_tensor(-torch.inf))
            m = m.to(torch.float64)
            self._max[name] = torch.maximum(self._max[name], m) if name in self._max else m
        else:
            raise ValueError(f"TokenStat.kind={stat.kind!r}; allowed: {list(KINDS)}")

    def _add_masked_mean(self, name: str, v: Tensor, w: Tensor, cache: dict) -> None:
        """``mean`` with a bool weight (the mask): the same sums as with its 0/1 float
        (``v * 1 = v``; the count is an exact integer), without the multiplication; the mask's
        bits and count are shared by the records of one :meth:`update` (``cache``)."""
        key = (id(w), v.dtype)
        if key not in cache:
            cache[key] = (mask_bits(w, v.dtype) if v.dtype != torch.bool else None,
                          w.sum().to(torch.float64))
        bits, den = cache[key]
        if v.dtype == torch.bool:
            num = (v & w).sum().to(torch.float64)
        else:
            num = zero_where_not(v, bits).sum(dtype=torch.float64)
        self._num[name] = self._num.get(name, 0) + num
        self._den[name] = self._den.get(name, 0) + den

    def update(self, stats: dict[str, TokenStat]) -> None:
        cache: dict = {}  # mask bits / counts shared by this update's records
        for name, stat in stats.items():
            self.add(name, stat, cache)

    def reduce(self, ctx: ReductionContext) -> dict[str, Tensor]:
        """All-reduce (2 collectives) and return ``{name: 0-dim fp32 tensor}``."""
        out: dict[str, Tensor] = {}
        mean_names, sum_names = sorted(self._num), sorted(self._sum)
        if mean_names or sum_names:
            vec = torch.stack([_t(self._num[n]) for n in mean_names]
                              + [_t(self._den[n]) for n in mean_names]
                              + [_t(self._sum[n]) for n in sum_names])
            ctx.all_reduce(vec)
            k = len(mean_names)
            for i, n in enumerate(mean_names):
                den = vec[k + i]
                out[n] = torch.where(den > 0, vec[i] / den.clamp_min(1e-300), 0.0).float()
            for i, n in enumerate(sum_names):
                out[n] = vec[2 * k + i].float()
        min_names, max_names = sorted(self._min), sorted(self._max)
        if min_names or max_names:
            vec = torch.stack([_t(self._min[n]) for n in min_names]
                              + [-_t(self._max[n]) for n in max_names])
            ctx.all_reduce(vec, op=dist.ReduceOp.MIN)
            vals = torch.where(torch.isfinite(vec), vec, 0.0)
            for i, n in enumerate(min_names):
                out[n] = vals[i].float()
            for i, n in enumerate(max_names):
                out[n] = (-vals[len(min_names) + i]).float()
        return dict(sorted(out.items()))


def _t(x: Tensor | float) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(float(x), dtype=torch.float64)
