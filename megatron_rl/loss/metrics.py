"""Globally reduced metrics, accumulated locally per micro-batch and reduced once per mini-batch.

A loss emits :class:`TokenStat` records; :class:`MetricAccumulator` keeps local sums (no host
sync) and :meth:`MetricAccumulator.reduce` reduces them with one collective (an ``all_gather``
of every mean/sum and every min and negated max, summed / minimised over the ranks locally). A
mean is ``global sum(value * weight) / global sum(weight)``, the mean over the whole mini-batch's
valid tokens whatever the layout.
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
KINDS = ("mean", "min", "max", "sum", "ratio")


@dataclass(frozen=True)
class TokenStat:
    """One metric contribution.

    ``mean``: ``value``/``weight`` are ``[B, T]`` (weight: mask of the tokens it averages over).
    ``min``/``max``: extremum of ``value`` over tokens with ``weight > 0``.
    ``sum``: ``value`` is 0-dim and summed over micro-batches and ranks (``weight`` unused).
    ``ratio``: a mean whose sums the loss already took: ``value`` (0-dim) is this micro-batch's
    sum of the values over the tokens, ``weight`` (0-dim) their count (see :func:`ratio_stat`).
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
    # bool tensors carry no gradient: kept as they are, so that records over one mask share it
    return TokenStat(value if value.dtype == torch.bool else value.detach().float(),
                     weight if weight.dtype == torch.bool else weight.detach().float(), "mean")


def ratio_stat(num: Tensor, den: Tensor) -> TokenStat:
    """A mean from one micro-batch's sums: ``num`` (0-dim, the sum of the values over its
    tokens) and ``den`` (0-dim, their count); reduced as ``sum(num) / sum(den)`` over the
    micro-batches and ranks like a ``mean`` record (the same fp64 sums when ``num`` is the fp64
    sum the ``mean`` record would take)."""
    return TokenStat(num.detach() if num.requires_grad else num,
                     den.detach() if den.requires_grad else den, "ratio")


class MetricAccumulator:
    """Local running sums of :class:`TokenStat` records of one mini-batch."""

    def __init__(self) -> None:
        self._num: dict[str, Tensor] = {}
        self._den: dict[str, Tensor] = {}
        self._min: dict[str, Tensor] = {}
        self._max: dict[str, Tensor] = {}
        self._sum: dict[str, Tensor] = {}
        # :meth:`update` keeps the sums of its masked means and sums in one fp64 vector (one
        # addition per micro-batch instead of two per record) while every update has the same
        # records; ``_vec_keys`` names its entries (dict, metric name).
        self._vec: Tensor | None = None
        self._vec_keys: tuple[tuple[str, str], ...] | None = None
        self._vectorised = True

    def _flush(self) -> None:
        """Move the running vector into the per-name sums (``0 + x`` as :meth:`add` starts)."""
        if self._vec is not None:
            for (store, name), x in zip(self._vec_keys, self._vec.unbind(), strict=True):
                d = getattr(self, store)
                d[name] = d[name] + x if name in d else x
        self._vec, self._vec_keys = None, None

    def add(self, name: str, stat: TokenStat, _cache: dict | None = None) -> None:
        """Accumulate one record (sync-free)."""
        if self._vec is not None:  # keep each sum's order of additions
            self._flush()
            self._vectorised = False
        v = stat.value.detach()
        if stat.kind == "sum":
            self._sum[name] = self._sum.get(name, 0) + v.sum(dtype=torch.float64)
            return
        if stat.kind == "ratio":
            self._num[name] = self._num.get(name, 0) + v.to(torch.float64)
            self._den[name] = self._den.get(name, 0) + stat.weight.detach().to(torch.float64)
            return
        if (stat.kind == "mean" and stat.weight is not None and stat.weight.dtype == torch.bool
                and stat.weight.shape == v.shape):
            self._add_masked_mean(name, v, stat.weight, {} if _cache is None else _cache)
            return
        if v.dtype == torch.bool:
            v = as_float(v)
        if stat.kind in ("min", "max") and stat.weight is None and v.dim() == 0:
            m = v.to(torch.float64)  # one value, no mask: it is its own extremum
            store, pick = ((self._min, torch.minimum) if stat.kind == "min"
                           else (self._max, torch.maximum))
            store[name] = pick(store[name], m) if name in store else m
            return
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
        """Accumulate one micro-batch's records: bool-masked means of bool values share one
        stacked count per mask, and every masked mean / sum lands in one fp64 vector added to
        the running one (the same fp64 additions in the same order as per-record sums)."""
        if not self._vectorised:
            cache: dict = {}  # mask bits / counts shared by this update's records
            for name, stat in stats.items():
                self.add(name, stat, cache)
            return
        keys: list[tuple[str, str]] = []
        parts: list[Tensor] = []
        dens: dict[int, Tensor] = {}
        bits: dict[tuple[int, torch.dtype], Tensor] = {}
        groups: dict[int, tuple[Tensor, list[str], list[Tensor]]] = {}
        rest: dict[str, TokenStat] = {}
        ratios: list[tuple[str, Tensor, Tensor]] = []
        for name, stat in stats.items():
            if stat.kind == "ratio":  # ratio_stat's tensors carry no gradient
                ratios.append((name, stat.value, stat.weight))
                continue
            v = stat.value.detach()
            w = stat.weight
            if stat.kind == "sum":
                keys.append(("_sum", name))
                parts.append(v.sum(dtype=torch.float64).reshape(1))
            elif (stat.kind == "mean" and w is not None and w.dtype == torch.bool
                  and w.shape == v.shape and v.dim() > 0):
                if id(w) not in dens:
                    dens[id(w)] = w.sum().to(torch.float64).reshape(1)
                if v.dtype == torch.bool:
                    groups.setdefault(id(w), (w, [], []))[1].append(name)
                    groups[id(w)][2].append(v)
                    continue
                if (id(w), v.dtype) not in bits:
                    bits[(id(w), v.dtype)] = mask_bits(w, v.dtype)
                keys += [("_num", name), ("_den", name)]
                parts += [zero_where_not(v, bits[(id(w), v.dtype)]).sum(dtype=torch.float64)
                          .reshape(1), dens[id(w)]]
            elif stat.kind in ("min", "max") and w is None and v.dim() == 0:
                self._extremum(name, v, stat.kind)
            else:
                rest[name] = stat
        if ratios:  # one stack of the numerators and one of the denominators
            keys += [("_num", n) for n, _, _ in ratios] + [("_den", n) for n, _, _ in ratios]
            parts.append(torch.stack([x for _, x, _ in ratios] + [d for _, _, d in ratios])
                         .detach().to(torch.float64))
        for wid, (w, names, vals) in groups.items():
            counts = (torch.stack(vals) & w).reshape(len(vals), -1).sum(1).to(torch.float64)
            keys += [("_num", n) for n in names] + [("_den", n) for n in names]
            parts += [counts, dens[wid].expand(len(names))]
        if parts:
            vec = torch.cat(parts)
            keys_t = tuple(keys)
            if self._vec is None and not any(n in getattr(self, d) for d, n in keys_t):
                self._vec, self._vec_keys = torch.zeros_like(vec) + vec, keys_t
            elif self._vec is not None and keys_t == self._vec_keys:
                self._vec = self._vec + vec
            else:  # the records changed: per-name sums from now on, same order of additions
                self._flush()
                self._vectorised = False
                for i, (d, n) in enumerate(keys_t):
                    store = getattr(self, d)
                    store[n] = store.get(n, 0) + vec[i]
        for name, stat in rest.items():
            self._add_rest(name, stat)

    def _extremum(self, name: str, v: Tensor, kind: str) -> None:
        """A 0-dim ``min`` / ``max`` record without weight: it is its own extremum (the same
        tensor as the running one, e.g. a constant repeated every micro-batch, changes
        nothing)."""
        store = self._min if kind == "min" else self._max
        have = store.get(name)
        if have is v:
            return
        m = v.to(torch.float64)
        if have is None:
            store[name] = m
        else:
            store[name] = (torch.minimum if kind == "min" else torch.maximum)(have, m)

    def _add_rest(self, name: str, stat: TokenStat) -> None:
        vectorised, self._vectorised = self._vectorised, False
        vec, self._vec = self._vec, None  # min / max records do not touch the vector
        try:
            self.add(name, stat)
        finally:
            self._vec, self._vectorised = vec, vectorised

    def reduce(self, ctx: ReductionContext) -> dict[str, Tensor]:
        """Reduce over the DP group and return ``{name: 0-dim fp32 tensor}``: one collective
        (an ``all_gather`` of this rank's sums and extrema, summed / minimised over the ranks in
        rank order, the same on every rank); none for a single process."""
        self._flush()
        self._vectorised = False
        out: dict[str, Tensor] = {}
        mean_names, sum_names = sorted(self._num), sorted(self._sum)
        min_names, max_names = sorted(self._min), sorted(self._max)
        sums = [_t(self._num[n]) for n in mean_names] + [_t(self._den[n]) for n in mean_names] \
            + [_t(self._sum[n]) for n in sum_names]
        mins = [_t(self._min[n]) for n in min_names] + [-_t(self._max[n]) for n in max_names]
        if not sums and not mins:
            return out
        vec = torch.stack(sums + mins)
        if ctx.group is not None and ctx.dp_size > 1:
            rows = [torch.empty_like(vec) for _ in range(ctx.dp_size)]
            dist.all_gather(rows, vec, group=ctx.group)  # the one collective of the metrics
            g = torch.stack(rows)
            vec = torch.cat([g[:, :len(sums)].sum(0), g[:, len(sums):].amin(0)])
        k, n_sums = len(mean_names), len(sums)
        num, den = vec[:k], vec[k:2 * k]
        parts = [torch.where(den > 0, num / den.clamp_min(1e-300), 0.0), vec[2 * k:n_sums]]
        if mins:
            ext = vec[n_sums:]
            vals = torch.where(torch.isfinite(ext), ext, 0.0)
            parts += [vals[:len(min_names)], -vals[len(min_names):]]
        values = torch.cat(parts).float().unbind()
        out = dict(zip(mean_names + sum_names + min_names + max_names, values, strict=True))
        return dict(sorted(out.items()))


def _t(x: Tensor | float) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(float(x), dtype=torch.float64)
