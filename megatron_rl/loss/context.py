"""The reduction context: the only object in ``megatron_rl.loss`` that talks to other processes.

Built **once per mini-batch**, before the micro-batch loop, from the masks of every micro-batch this
rank holds. :meth:`ReductionContext.from_minibatch` does one ``all_gather`` of a few integers over
the data-parallel (DP) group and from them knows:

* ``num_tokens``: valid response tokens of the whole mini-batch (all DP ranks, all micro-batches);
* ``num_seqs``: sequences with at least one valid token, same scope;
* ``max_len``: the largest padded response length T of any micro-batch on any rank;
* ``seq_offset``: the global index of this rank's first sequence.

Global layout convention: the mini-batch is the concatenation of DP rank 0's sequences, then rank
1's, ...; within a rank, micro-batch 0's rows, then micro-batch 1's, .... A token's **global index**
is ``seq_idx * max_len + t`` (``t`` = position in the right-padded response). Only the order of
this index matters (it breaks ties in top-k selections), and that order is the same for any stride
>= T, so padding differences between layouts do not change any selection.

Gradient convention (read this before wiring the loss into a DP optimizer)
-------------------------------------------------------------------------
A micro-batch's ``loss`` is ``sum(local contributions) / global denominator``. Summing ``loss`` over
all micro-batches **and** all DP ranks gives the mini-batch loss of one process holding all of it,
and **summing** parameter gradients over DP ranks gives that process's gradient. Megatron DDP
*averages* gradients over DP, so back-propagate ``loss * ctx.grad_scale`` with
``grad_scale = dp_size`` (the default, ``dp_grad_average=True``); after DDP's average the gradient
equals the single-process gradient. With context parallelism (``parallel.cp``) every CP rank of a
DP replica computes the same loss from the CP-summed per-token values
(:mod:`megatron_rl.parallel.context_parallel`) and its backward reaches only its own tokens, so
the replica's gradient is the *sum* over its CP ranks; megatron DDP averages over DP x CP and
megatron's schedule multiplies a ``(loss, dict)`` loss by the CP size
(``pipeline_parallel/schedules.py``, ``forward_step_calc_loss``), so ``grad_scale`` stays
``dp_size``. Every token reduction here (counts, selections) is over the DP group only: the CP
ranks of a replica already see all of its tokens. If the megatron schedule also divides each
micro-batch loss by the number of micro-batches (``calculate_per_token_loss=False``), multiply by
that number as well.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.loss.masking import adjacent_view, count_true

Tensor = torch.Tensor


def default_dp_group() -> object | None:
    """Megatron's DP group when ``parallel_state`` is initialised, else WORLD, else ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_data_parallel_group()
    except ImportError:  # megatron-core is optional for the loss module
        pass
    return dist.group.WORLD


def as_list(x: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """A micro-batch list: a single ``[B, T]`` tensor becomes a one-element list."""
    return [x] if isinstance(x, Tensor) else list(x)


@dataclass
class ReductionContext:
    """Global denominators and collectives of one mini-batch (see the module docstring).

    Counts are 0-dim device tensors (no host sync). ``group=None`` means a single process.
    """

    group: object | None
    dp_size: int
    dp_rank: int
    num_tokens: Tensor  # int64, global valid tokens
    num_seqs: Tensor  # int64, global sequences with >= 1 valid token
    max_len: Tensor  # int64, global max padded T
    seq_offset: Tensor  # int64, global index of this rank's first sequence
    mb_seq_offsets: list[int]  # local row offset of each micro-batch (host ints, from shapes)
    extra_counts: dict[str, Tensor] = field(default_factory=dict)
    dp_grad_average: bool = True
    numel_bound: int | None = None  # host bound of the global padded token count (None: unknown)
    # global sequence index [B_m] of each micro-batch's rows when they are not this rank's rows
    # in order (token-budget micro-batches); None: seq_offset + row order
    seq_ids: list[Tensor] | None = None

    # ---- construction -------------------------------------------------------------------------
    @staticmethod
    def from_minibatch(masks: Tensor | Sequence[Tensor], group: object | None = "default",
                       dp_grad_average: bool = True,
                       extra_masks: dict[str, Sequence[Tensor]] | None = None,
                       numel_bound: int | None = None,
                       rank_numel_bound: int | None = None,
                       seq_ids: Sequence[Tensor] | None = None) -> ReductionContext:
        """Build the context from this rank's micro-batch masks (each ``[B_m, T_m]``).

        One ``all_gather`` over ``group`` (``"default"``: :func:`default_dp_group`). ``extra_masks``
        maps a name to per-micro-batch ``[B_m, T_m]`` masks whose global valid count is needed
        too (e.g. ``"positive"`` tokens of the GPPO NLL term); read it with :meth:`count`.
        ``numel_bound``: a host upper bound of the padded tokens ``sum B_m * T_m`` of all DP
        ranks together (the same on every rank); it sizes the candidate exchange of the global
        top-k selections. Left ``None`` it is known without asking: one process, or a DP group
        whose counts are CPU tensors (gloo); otherwise (device tensors) those selections fall
        back to a radix selection of four collectives. ``rank_numel_bound``: a host upper bound
        of the padded tokens of any **one** rank, the same on every rank (e.g. this rank's rows
        times the model's maximum sequence length, see
        :func:`rank_token_bound`); it gives
        ``numel_bound = dp_size * rank_numel_bound`` on any backend, and each rank checks its own
        micro-batch shapes against it (host integers, no sync; ``ValueError`` when they exceed
        it). ``seq_ids``: per micro-batch ``[B_m]``
        int64, the global sequence index of each row (rows regrouped by token budget or
        balanced over DP); None: the rows of all ranks in rank order.
        """
        masks = as_list(masks)
        if not masks:
            raise ValueError("from_minibatch needs at least one micro-batch mask")
        if group == "default":
            group = default_dp_group()
        device = masks[0].device
        if rank_numel_bound is not None:
            have = sum(m.numel() for m in masks)
            if have > rank_numel_bound:
                raise ValueError(
                    f"from_minibatch(rank_numel_bound={rank_numel_bound}): this rank's "
                    f"micro-batches hold {have} padded tokens (shapes "
                    f"{[tuple(m.shape) for m in masks]}); the bound must be >= every rank's "
                    "sum of B_m * T_m (rows x maximum sequence length)")
        names = sorted(extra_masks or {})
        local = _local_counts(masks, [as_list(extra_masks[n]) for n in names], device)
        if group is None:
            rows = local.unsqueeze(0)
            rank, size = 0, 1
            if rank_numel_bound is not None:
                numel_bound = rank_numel_bound
            if numel_bound is None:
                numel_bound = sum(m.numel() for m in masks)
        else:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)  # the one collective of this method
            rows = torch.stack(gathered)
            if rank_numel_bound is not None:
                numel_bound = size * rank_numel_bound
            elif numel_bound is None and rows.device.type == "cpu":  # host values: no sync
                numel_bound = int((rows[:, 2] * rows[:, 3]).sum())
        totals = rows.sum(0)
        offsets = [0]
        for m in masks[:-1]:
            offsets.append(offsets[-1] + m.shape[0])
        return ReductionContext(
            group=group, dp_size=size, dp_rank=rank, num_tokens=totals[0], num_seqs=totals[1],
            max_len=rows[:, 3].max(), seq_offset=rows[:rank, 2].sum(),
            mb_seq_offsets=offsets,
            extra_counts={n: totals[4 + i] for i, n in enumerate(names)},
            dp_grad_average=dp_grad_average, numel_bound=numel_bound,
            seq_ids=None if seq_ids is None else list(seq_ids))

    # ---- denominators -------------------------------------------------------------------------
    @functools.cached_property
    def token_denominator(self) -> Tensor:
        """Global valid-token count as fp32, at least 1 (an empty mini-batch gives loss 0);
        computed once per context."""
        return self.num_tokens.clamp_min(1).to(torch.float32)

    @functools.cached_property
    def seq_denominator(self) -> Tensor:
        """Global count of non-empty sequences as fp32, at least 1; computed once."""
        return self.num_seqs.clamp_min(1).to(torch.float32)

    @functools.cached_property
    def _constants(self) -> dict[tuple[float, str], Tensor]:
        return {}

    def constant(self, value: float, device: torch.device) -> Tensor:
        """0-dim fp64 tensor of the host number ``value`` on ``device``, made once per context
        (a record that repeats a constant every micro-batch shares it)."""
        key = (float(value), str(device))
        if key not in self._constants:
            self._constants[key] = torch.tensor(float(value), dtype=torch.float64,
                                                device=device)
        return self._constants[key]

    def count(self, name: str) -> Tensor:
        """Global valid count of an ``extra_masks`` entry (int64, 0-dim)."""
        if name not in self.extra_counts:
            raise KeyError(f"count {name!r} was not requested in from_minibatch(extra_masks=...); "
                           f"have {sorted(self.extra_counts)}")
        return self.extra_counts[name]

    def restricted(self, tokens: str, rows: str) -> ReductionContext:
        """This context with the token and non-empty-sequence counts of two ``extra_masks``
        entries (``[B_m, T_m]`` tokens, ``[B_m, 1]`` rows holding one): the denominators of a
        narrower mask, e.g. the tokens a rollout correction keeps. Made once per context."""
        key = (tokens, rows)
        cache = self.__dict__.setdefault("_restricted", {})
        if key not in cache:
            cache[key] = dataclasses.replace(self, num_tokens=self.count(tokens),
                                             num_seqs=self.count(rows))
        return cache[key]

    @property
    def grad_scale(self) -> float:
        """Multiply the loss by this before backward: ``dp_size`` when DP averages gradients."""
        return float(self.dp_size) if self.dp_grad_average else 1.0

    # ---- global indices -----------------------------------------------------------------------
    def seq_index(self, micro_batch: int, rows: int, device: torch.device | None = None) -> Tensor:
        """Global sequence index ``[rows]`` (int64) of the rows of local micro-batch
        ``micro_batch``."""
        if self.seq_ids is not None:
            return self.seq_ids[micro_batch].to(device or self.seq_offset.device)
        start = self.seq_offset.to(device or self.seq_offset.device)
        local = torch.arange(rows, device=start.device) + self.mb_seq_offsets[micro_batch]
        return start + local

    # ---- collectives --------------------------------------------------------------------------
    def all_reduce(self, t: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        """In-place all-reduce over the DP group (no-op for a single process); returns ``t``."""
        if self.group is not None and self.dp_size > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t


def rank_token_bound(masks: Sequence[Tensor], max_seq_len: int | None) -> int | None:
    """Host upper bound of one DP rank's padded tokens in a mini-batch, the same on every rank
    when every rank holds the same number of rows (the trainer's ``mini_batch_size / dp``): the
    rows of ``masks`` (``[B_m, T_m]`` each) times ``max_seq_len`` (the model's maximum sequence
    length, ``T_m <= max_seq_len``); ``None`` when it is unknown. For
    :meth:`ReductionContext.from_minibatch`'s ``rank_numel_bound`` (no host sync on any
    backend)."""
    if not max_seq_len:
        return None
    return sum(int(m.shape[0]) for m in masks) * int(max_seq_len)


def _local_counts(masks: list[Tensor], extra: list[list[Tensor]], device: torch.device) -> Tensor:
    """``[4 + len(extra)]`` int64: valid tokens, non-empty seqs, rows, max T, extra counts.
    Counts by :func:`count_true` / byte sums (int32 accumulators: fewer than 2**31 tokens per
    rank), row maxima of the ``uint8`` views for the non-empty rows: fast reductions on CPU."""
    rows = sum(m.shape[0] for m in masks)
    max_t = max(m.shape[-1] for m in masks)
    bools = [m.bool() for m in masks]
    if all(m.dim() == 2 and m.shape[-1] == max_t for m in bools):  # one [rows, T] mask
        n = sum(m.numel() for m in bools)
        every = adjacent_view(bools, torch.bool, n)  # row slices of one mask: no copy
        every = torch.cat(bools) if every is None else every.view(rows, max_t)
        tokens = count_true(every)
        nonempty = every.view(torch.uint8).amax(-1).sum(dtype=torch.int32)
    else:
        tokens = torch.stack([count_true(m) for m in bools]).sum()
        nonempty = torch.stack([m.view(torch.uint8).amax(-1).sum(dtype=torch.int32)
                                for m in bools]).sum()
    head = [tokens.to(device=device, dtype=torch.int64),
            nonempty.to(device=device, dtype=torch.int64),
            torch.tensor([rows, max_t], dtype=torch.int64, device=device)]
    tail = [torch.stack([x.bool().sum() for x in ms]).sum().to(device=device, dtype=torch.int64)
            .reshape(1) for ms in extra]
    return torch.cat([head[0].reshape(1), head[1].reshape(1), head[2]] + tail)
