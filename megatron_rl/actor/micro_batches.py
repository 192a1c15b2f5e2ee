"""Token-budget micro-batches and DP load balancing by token count (pure host functions).

A row's *length* is what a forward pass must see of it: its last response position + 1 (the
model is causal, so nothing after the last scored token changes a log-prob or a value); an empty
row (no response token) has length 1. With ``actor.max_tokens_per_micro_batch = budget``:

- :func:`token_budget_groups` cuts rows into micro-batches whose *processed* tokens stay within
  ``budget``: padded rows cost ``rows x longest row of the micro-batch`` (each micro-batch is
  padded to its own longest row, not the step's); packed rows (``packed=True``, one THD row per
  micro-batch) cost the sum of their lengths. Rows are taken longest first (sorted greedy), so
  rows of similar length share a micro-batch and padding stays small. With context parallelism
  (``parallel.cp`` > 1) the budget counts the tokens **each rank** processes after the CP split:
  a micro-batch's rows are padded to a multiple of ``2 x cp`` and each rank holds ``1/cp`` of
  them, so a micro-batch carries up to ``cp x budget`` tokens of rows (:func:`rank_tokens`).
- :func:`balance_over_dp` spreads the rows of one global mini-batch over DP ranks, the same
  number of rows each, so that every rank gets about the same number of tokens (sorted greedy:
  the longest row goes to the rank with the fewest tokens that still has room).
- every DP rank must run the same number of micro-batches (the pipeline schedule, the gradient
  all-reduce and, with experts, every MoE layer's all-to-all are collective), in the update and
  in the forward-only passes alike: :func:`fill_to_agreed_count` takes the maximum over DP
  (:func:`agree_count` over megatron's gloo DP group, :func:`dp_host_group`) and the ranks with
  fewer micro-batches add empty ones (one row, no response token: zero weight, outputs dropped).

:func:`padding_metrics` defines ``actor/pad_fraction`` (padding tokens / all tokens processed)
and ``actor/tokens_per_micro_batch`` (tokens processed per micro-batch) for every path.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

PAD_FRACTION = "actor/pad_fraction"
TOKENS_PER_MICRO_BATCH = "actor/tokens_per_micro_batch"


class TokenBudgetError(ValueError):
    """A row does not fit in the token budget of one micro-batch."""


def row_lengths(mask: torch.Tensor) -> list[int]:
    """Host list of row lengths of ``mask`` ``[N, S]`` (any device): last response position + 1,
    at least 1 (one host sync)."""
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask.bool() * pos).amax(1).clamp_min(1)
    return [int(v) for v in last.cpu().tolist()]


def rank_tokens(length: int, cp: int = 1) -> int:
    """Tokens of a padded row of ``length`` that one rank processes under context parallelism
    ``cp``: the row rounded up to a multiple of ``2 x cp``, divided by ``cp`` (``length`` at
    CP 1)."""
    if cp <= 1:
        return length
    return -(-length // (2 * cp)) * 2


def group_cost(lengths: Sequence[int], packed: bool = False, cp: int = 1) -> int:
    """Tokens processed (per rank, after a ``cp`` split) by one micro-batch of rows with these
    lengths."""
    if not lengths:
        return 0
    if packed:  # under CP each segment is padded to 2 x cp and split
        return sum(rank_tokens(n, cp) for n in lengths)
    return len(lengths) * rank_tokens(max(lengths), cp)


def token_budget_groups(lengths: Sequence[int], budget: int, packed: bool = False,
                        cp: int = 1) -> list[list[int]]:
    """Rows (indices into ``lengths``) grouped into micro-batches of at most ``budget``
    processed tokens (see :func:`group_cost`). Longest rows first; indices ascending inside a
    group; groups ordered by their longest row (descending). A row longer than ``budget`` is a
    :class:`TokenBudgetError` (the config check refuses such budgets at load time). ``cp``:
    padded rows are costed per rank after the context-parallel split (:func:`rank_tokens`)."""
    if budget < 1:
        raise TokenBudgetError(f"actor.max_tokens_per_micro_batch must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    def cost(n: int) -> int:
        return rank_tokens(n, cp)

    if order and cost(lengths[order[0]]) > budget:
        i = order[0]
        per_rank = f" ({cost(lengths[i])} per rank at parallel.cp={cp})" if cp > 1 else ""
        raise TokenBudgetError(f"row {i} has {lengths[i]} tokens{per_rank}, more than "
                               f"actor.max_tokens_per_micro_batch={budget}")
    groups: list[list[int]] = []
    sums: list[int] = []
    for i in order:
        n = lengths[i]
        if packed:  # first fit decreasing on the summed (per-rank) length
            c = cost(n)
            for g, total in enumerate(sums):
                if total + c <= budget:
                    groups[g].append(i)
                    sums[g] += c
                    break
            else:
                groups.append([i])
                sums.append(c)
        elif groups and (len(groups[-1]) + 1) * cost(lengths[groups[-1][0]]) <= budget:
            groups[-1].append(i)  # sorted: the group's first row is its longest
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def balance_over_dp(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Rows of one global mini-batch (indices into ``lengths``) for each of ``dp`` ranks:
    ``len(lengths) / dp`` rows each, token sums as equal as sorted greedy makes them; indices
    ascending per rank. ``len(lengths)`` must be a multiple of ``dp``."""
    n = len(lengths)
    if dp < 1 or n % dp:
        raise ValueError(f"{n} rows cannot be split evenly over {dp} data-parallel ranks")
    cap = n // dp
    parts: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(dp) if len(parts[r]) < cap), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += lengths[i]
    return [sorted(p) for p in parts]


def balanced_dp_rows(lengths: Sequence[int], dp: int, dp_rank: int, mini: int) -> torch.Tensor:
    """Row indices (int64) of ``dp_rank`` in a step of ``len(lengths)`` rows: every global
    mini-batch of ``mini`` rows (0: all) balanced by :func:`balance_over_dp`."""
    n = len(lengths)
    mini = mini or n
    out = []
    for start in range(0, n, mini):
        part = balance_over_dp(lengths[start:start + mini], dp)[dp_rank]
        out += [start + i for i in part]
    return torch.tensor(out, dtype=torch.int64)


def agree_count(count: int, group=None, device: torch.device | str = "cpu") -> int:
    """The maximum of ``count`` over ``group`` (one all-reduce of one int64 on ``device``, the
    group's device: CPU with gloo, the GPU with NCCL; one host sync)."""
    if group is None or dist.get_world_size(group) == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def dp_host_group():
    """megatron's gloo data-parallel group (made by ``initialize_model_parallel``): host ints
    such as micro-batch counts agree over it without a device round trip. None when megatron's
    parallel state is not initialised (one process)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_group_gloo()


def padding_metrics(real_tokens: float, processed_tokens: float, n_micro: float
                    ) -> dict[str, float]:
    """``actor/pad_fraction`` and ``actor/tokens_per_micro_batch`` from summed counts."""
    return {PAD_FRACTION: 1.0 - real_tokens / processed_tokens if processed_tokens else 0.0,
            TOKENS_PER_MICRO_BATCH: processed_tokens / n_micro if n_micro else 0.0}


def take_rows(batch: dict, rows: Sequence[int], length: int, seq: int) -> dict:
    """Rows ``rows`` of ``batch`` (``[N, ...]`` tensors; ``[N, seq]`` ones cut to ``length``
    columns); other values are passed through. Tensors stay on their device."""
    out = {}
    idx = None
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            out[k] = v
            continue
        if idx is None or idx.device != v.device:
            idx = torch.tensor(list(rows), dtype=torch.int64, device=v.device)
        t = v.index_select(0, idx)
        out[k] = t[:, :length] if t.dim() >= 2 and t.shape[1] == seq else t
    return out


def empty_micro_batch(batch: dict, seq: int) -> dict:
    """A zero-weight micro-batch: row 0 of ``batch`` cut to one token, no response token."""
    mb = take_rows(batch, [0], 1, seq)
    mb["mask"] = torch.zeros_like(mb["mask"])
    if "positive" in mb:
        mb["positive"] = torch.zeros_like(mb["positive"])
    return mb


def fill_to_agreed_count(mbs: list[dict], batch: dict, seq: int, group=None) -> list[dict]:
    """``mbs`` plus :func:`empty_micro_batch` fillers (from ``batch``'s row 0, ``[N, seq]``) up to
    the largest micro-batch count over ``group`` (a gloo group, e.g. :func:`dp_host_group`;
    None: no agreement). Fillers come last, so callers that keep one output per real micro-batch
    (:func:`unsplit_rows`) drop theirs."""
    n = agree_count(len(mbs), group)
    return mbs + [empty_micro_batch(batch, seq) for _ in range(n - len(mbs))]


def unsplit_rows(parts: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], n: int,
                 seq: int) -> torch.Tensor:
    """Inverse of :func:`take_rows` for per-token outputs: ``parts[g]`` ``[B_g, T_g]`` back into
    one ``[n, seq]`` tensor (zeros beyond ``T_g``), on the parts' device and dtype."""
    ref = parts[0]
    out = torch.zeros((n, seq, *ref.shape[2:]), dtype=ref.dtype, device=ref.device)
    for p, rows in zip(parts, groups):
        idx = torch.tensor(list(rows), dtype=torch.int64, device=ref.device)
        out[idx, :p.shape[1]] = p
    return out


def budget_micro_batches(batch: dict, rows: slice, budget: int, seq_ids: torch.Tensor | None,
                         group=None, packed: bool = False, cp: int = 1) -> list[dict]:
    """Token-budget micro-batches of ``batch``'s rows ``rows`` (one mini-batch of this rank),
    each cut to its longest row; ``seq_ids`` ``[rows]`` int64 (their global sequence indices,
    on the batch's device) travel as ``mb["seq_id"]``. With ``group`` (the gloo DP group,
    :func:`dp_host_group`) every rank ends with the same count (:func:`fill_to_agreed_count`).
    ``packed``: the budget counts summed lengths (each micro-batch runs as one packed row).
    ``cp``: the budget counts each rank's tokens after the context-parallel split."""
    sub = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in batch.items()}
    if seq_ids is not None:
        sub["seq_id"] = seq_ids
    seq = sub["tokens"].shape[1]
    lengths = row_lengths(sub["mask"])
    groups = token_budget_groups(lengths, budget, packed, cp)
    mbs = [take_rows(sub, g, max(lengths[i] for i in g), seq) for g in groups]
    return fill_to_agreed_count(mbs, sub, seq, group)


def budget_forward_batches(batch: dict, budget: int, packed: bool = False, group=None,
                           cp: int = 1) -> tuple[list[dict], list[list[int]]]:
    """Forward-only passes: all of this rank's rows in token-budget micro-batches; returns the
    micro-batches and the row groups of the real ones (for :func:`unsplit_rows`). With ``group``
    (the gloo DP group, :func:`dp_host_group`) every rank runs the same count, fillers last
    (:func:`fill_to_agreed_count`): with experts each forward is an all-to-all over DP ranks.
    ``cp``: the budget counts each rank's tokens after the context-parallel split."""
    seq = batch["tokens"].shape[1]
    lengths = row_lengths(batch["mask"])
    groups = token_budget_groups(lengths, budget, packed, cp)
    mbs = [take_rows(batch, g, max(lengths[i] for i in g), seq) for g in groups]
    return fill_to_agreed_count(mbs, batch, seq, group), groups


def global_seq_ids(batch: dict, rows: slice, dp: int, dp_rank: int) -> torch.Tensor:
    """``[rows]`` int64 global sequence index (inside its global mini-batch) of this rank's rows
    ``rows`` of one mini-batch: ``batch["row_index"] % (dp x rows)`` when the rows were balanced
    over DP (the step row index, see :func:`balanced_dp_rows`), else the contiguous DP blocks'
    ``dp_rank x rows + i``. On the batch's device."""
    n = rows.stop - rows.start
    if "row_index" in batch:
        return batch["row_index"][rows] % (n * dp)
    return torch.arange(dp_rank * n, (dp_rank + 1) * n, device=batch["mask"].device)
