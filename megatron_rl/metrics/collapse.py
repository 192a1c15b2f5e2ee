"""RAGEN-2 collapse diagnostics of multi-turn runs (``collapse/*``): how much the reasoning ``Z``
of the first reply varies under one input ``X`` (``H(Z|X)``) and how much it still depends on the
input (``I(X;Z)``), under the batch's empirical input distribution (uniform over the inputs).

Partition (RAGEN's ``first_turn_prompt_ids`` / ``first_turn_reasoning_ids``):

* ``X``: the first user turn (instructions + first observation, as rendered for the model) and the
  first reply up to and including the opening tag (``<think>``);
* ``Z``: the first reply's reasoning content, between the tags, both excluded. A reply without a
  complete ``<think>...</think>`` pair has no ``Z`` and is left out (``collapse/valid_rate``).
  ``reasoning: reply`` takes the whole first reply (its EOS excluded) as ``Z`` and the prompt as
  ``X``, for models that answer without tags (the tiny recipes).

Inputs are the episode groups (one ``uid``, one env seed; samples of a group whose ``X`` differ
form their own input). With ``N`` inputs and ``M`` reasoning samples, every ``z_i`` is scored under
every ``x_j`` (teacher forcing, current weights, no grad): ``L[i, j] = log p(z_i | x_j)`` summed
over ``Z``'s ``T_i`` tokens, and per token ``l[i, j] = L[i, j] / T_i``. With ``c_i`` the input
``z_i`` was sampled from::

    matched_i  = l[i, c_i]                            H(Z|X) ~ -mean_i matched_i
    marginal_i = logsumexp_j l[i, j] - log N          H(Z)   ~ -mean_i marginal_i
    I(X;Z)     ~ mean_i (matched_i - marginal_i)      (<= log N; may dip below 0 by noise)

and the same on ``L`` (``*_seq``); retrieval accuracy ``argmax_j l[i, j]`` has ``z_i``'s input
(inputs with identical ``X`` count as one); ``mi_zscore = mean_i (matched_i - marginal_i) /
(std(marginal) + 1e-3)``.

Reference (read, not copied): mll-lab-nu/RAGEN@18918cd7a20931bf85ebdeef61ab027c8f467cf0:
``ragen/trainer/collapse_metrics.py`` (``CollapseDetector``: ``_compute_cross_log_probs``,
``_compute_log_prob_stats``, ``_compute_mi_estimate``, ``_compute_retrieval_accuracy``,
``_compute_reasoning_entropy``) and mll-lab-nu/RAGEN@2468d7c437911dbae59339155702aafddab76bf9:
``docs/reference_mutual_information_metrics.md`` (the partition, §2; the estimators, §4-7).
Not here: RAGEN's EMA-normalised z-score, top-k retrieval and its multi-turn trajectory sample.

Cost: one forward-only pass over ``N x M`` rows of first-turn length (prompt + first reply) every
``trainer.collapse_metrics.every_n_steps`` steps; ``N <= max_inputs`` inputs and their ``M = N x
rollout.n`` samples, so ``max_inputs^2 x rollout.n`` rows (8 inputs x 8 samples: 512 short rows).
The rows are spread over DP ranks like a batch; TP/PP/CP run them as the old-policy pass does;
the ``[M, N]`` matrix is summed over DP (one all-reduce) and the statistics need one host copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor
STD_EPS = 1e-3  # RAGEN's std_eps


@dataclass
class Pair:
    """One first-turn sample: its group ``uid``, input ``x`` and reasoning ``z`` token ids."""

    uid: int
    x: list[int]
    z: list[int]


def _find(seq: Sequence[int], sub: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of ``sub`` in ``seq`` at or after ``start``; -1 if none."""
    n = len(sub)
    for i in range(start, len(seq) - n + 1):
        if list(seq[i:i + n]) == list(sub):
            return i
    return -1


def first_turn_pair(record: dict, eos_id: int, reasoning: str, open_ids: Sequence[int],
                    close_ids: Sequence[int]) -> Pair | None:
    """The ``(X, Z)`` split of a multi-turn episode record's first reply (module docstring);
    None when the reply has no reasoning (no complete tag pair, or nothing between the tags)."""
    prompt = list(record["prompt_ids"])
    reply = list(record["response_ids"][:record["turn_ends"][0] + 1]) if record["turn_ends"] \
        else []
    if reasoning == "reply":
        z = reply[:-1] if reply and reply[-1] == eos_id else reply
        return Pair(int(record["uid"]), prompt, z) if z else None
    start = _find(reply, open_ids)
    if start < 0:
        return None
    begin = start + len(open_ids)
    end = _find(reply, close_ids, begin)
    if end <= begin:
        return None
    return Pair(int(record["uid"]), prompt + reply[:begin], reply[begin:end])


@dataclass
class CrossPlan:
    """What every rank needs to assemble the cross-scoring matrix: ``sample_input [M]`` (the
    column ``c_i`` of each sample), ``lengths [M]`` (``T_i``), ``signature [N]`` (inputs with
    equal ``X`` share a number), the counts of first replies seen and with reasoning."""

    sample_input: list[int]
    lengths: list[int]
    signature: list[int]
    replies: int
    valid: int

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.sample_input), len(self.signature)


def plan_pairs(pairs: Sequence[Pair | None], max_inputs: int
               ) -> tuple[list[list[int]], list[Pair], CrossPlan]:
    """Inputs (the first ``max_inputs`` distinct ``(uid, X)`` in record order), their samples
    and the plan. Returns ``(inputs' X ids, samples, plan)``."""
    keys: dict[tuple, int] = {}
    inputs: list[list[int]] = []
    samples: list[Pair] = []
    cols: list[int] = []
    for p in pairs:
        if p is None:
            continue
        key = (p.uid, tuple(p.x))
        if key not in keys:
            if len(inputs) >= max_inputs:
                continue
            keys[key] = len(inputs)
            inputs.append(p.x)
        samples.append(p)
        cols.append(keys[key])
    sigs: dict[tuple, int] = {}
    signature = [sigs.setdefault(tuple(x), len(sigs)) for x in inputs]
    plan = CrossPlan(cols, [len(p.z) for p in samples], signature, len(pairs),
                     sum(p is not None for p in pairs))
    return inputs, samples, plan


def cross_rows(inputs: Sequence[list[int]], samples: Sequence[Pair], pad_id: int,
               rows_multiple: int) -> dict[str, Tensor]:
    """Host batch of every ``[x_j | z_i]``: ``tokens/mask [R, S]`` (mask on ``z_i``),
    ``collapse_cell [R]`` int64 (``i * N + j``; ``M * N`` on padding rows). Row ``i * N + j``;
    ``R`` padded with empty rows to a multiple of ``rows_multiple``."""
    n, m = len(inputs), len(samples)
    rows = n * m
    r_pad = -(-rows // rows_multiple) * rows_multiple
    seq = max(len(x) for x in inputs) + max(len(s.z) for s in samples)
    tokens = torch.full((r_pad, seq), pad_id, dtype=torch.long)
    mask = torch.zeros((r_pad, seq), dtype=torch.bool)
    cell = torch.full((r_pad,), rows, dtype=torch.long)
    for i, s in enumerate(samples):
        for j, x in enumerate(inputs):
            r = i * n + j
            tokens[r, :len(x) + len(s.z)] = torch.tensor(x + s.z)
            mask[r, len(x):len(x) + len(s.z)] = True
            cell[r] = r
    return {"tokens": tokens, "mask": mask, "collapse_cell": cell}


def cross_matrix(logp: Tensor, batch: dict[str, Tensor], shape: tuple[int, int],
                 group=None) -> Tensor:
    """``L [M, N]`` fp64 (``log p(z_i | x_j)`` summed over ``Z``) from this rank's rows' ``logp``
    ``[R, S]`` (zero outside the mask), summed over ``group`` (the DP group): each rank adds the
    cells of its rows. On ``logp``'s device; one all-reduce, no host sync."""
    m, n = shape
    dev = logp.device
    sums = torch.where(batch["mask"].to(dev), logp.double(), 0.0).sum(dim=1)
    flat = torch.zeros(m * n + 1, dtype=torch.float64, device=dev)
    flat.index_add_(0, batch["collapse_cell"].to(dev), sums)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    return flat[:m * n].view(m, n)


def collapse_statistics(seq_logp: Tensor, lengths: Tensor, sample_input: Tensor,
                        signature: Tensor) -> dict[str, Tensor]:
    """The ``collapse/*`` statistics (0-dim fp64 tensors on ``seq_logp``'s device).

    ``seq_logp [M, N]``: ``log p(z_i | x_j)`` summed over ``z_i``'s tokens; ``lengths [M]``:
    ``T_i``; ``sample_input [M]`` int64: ``c_i``; ``signature [N]`` int64: equal for inputs with
    the same ``X`` (they count as one for retrieval). See the module docstring.
    """
    m, n = seq_logp.shape
    dev = seq_logp.device
    rows = torch.arange(m, device=dev)
    tok_logp = seq_logp / lengths.to(dev).double().clamp_min(1.0).unsqueeze(1)
    out: dict[str, Tensor] = {}
    for suffix, mat in (("", tok_logp), ("_seq", seq_logp)):
        matched = mat[rows, sample_input]
        marginal = torch.logsumexp(mat, dim=1) - math.log(n)
        gap = matched - marginal
        std = marginal.std(unbiased=False) if m > 1 else torch.zeros_like(marginal[0])
        out[f"collapse/mi_estimate{suffix}"] = gap.mean()
        out[f"collapse/conditional_entropy{suffix}"] = -matched.mean()
        out[f"collapse/reasoning_entropy{suffix}"] = -marginal.mean()
        out[f"collapse/matched_logp{suffix}"] = matched.mean()
        out[f"collapse/marginal_logp{suffix}"] = marginal.mean()
        out[f"collapse/marginal_std{suffix}"] = std
        out[f"collapse/mi_zscore{suffix}"] = (gap / (std + STD_EPS)).mean()
    sig = signature.to(dev)
    true_sig = sig[sample_input]
    acc = (sig[tok_logp.argmax(dim=1)] == true_sig).double().mean()
    chance = (sig.unsqueeze(0) == true_sig.unsqueeze(1)).double().sum(dim=1).mean() / n
    out["collapse/retrieval_accuracy"] = acc
    out["collapse/retrieval_chance_level"] = chance
    out["collapse/retrieval_above_chance"] = acc - chance
    out["collapse/mi_upper_bound"] = torch.tensor(math.log(n), dtype=torch.float64, device=dev)
    return out


def build_cross_batch(records: Sequence[dict], tokenizer, cfg, rows_multiple: int
                      ) -> tuple[dict[str, Tensor] | None, CrossPlan | None]:
    """Rank 0: the cross-scoring rows of a step's episode ``records`` and their plan, from
    ``cfg`` (``trainer.collapse_metrics``); ``(None, plan)`` with fewer than 2 inputs."""
    open_ids = tokenizer.encode(cfg.think_open) if cfg.reasoning == "think" else []
    close_ids = tokenizer.encode(cfg.think_close) if cfg.reasoning == "think" else []
    pairs = [first_turn_pair(r, tokenizer.eos_id, cfg.reasoning, open_ids, close_ids)
             for r in records]
    inputs, samples, plan = plan_pairs(pairs, cfg.max_inputs)
    if len(inputs) < 2:
        return None, plan
    return cross_rows(inputs, samples, tokenizer.pad_id, rows_multiple), plan


def collapse_metrics(actor, local: dict[str, Tensor] | None, plan: CrossPlan | None
                     ) -> dict[str, float]:
    """Every rank: score this rank's cross rows ``local`` with ``actor`` (forward only, current
    weights) and return the ``collapse/*`` metrics on the last pipeline stage (``{}`` elsewhere;
    only the coverage counts when there were fewer than 2 inputs)."""
    out: dict[str, Any] = {}
    if plan is not None and plan.replies:
        out["collapse/valid_rate"] = plan.valid / plan.replies
    if local is None or plan is None:
        return out
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel import runtime

    dev = runtime.device()
    local = {k: v.to(dev) for k, v in local.items()}
    scored = actor.logprobs({"tokens": local["tokens"], "mask": local["mask"]},
                            compute_entropy=False)
    if scored is None:  # not the last pipeline stage
        return {}
    mat = cross_matrix(scored["logp"], local, plan.shape, ps.get_data_parallel_group())
    stats = collapse_statistics(mat, torch.tensor(plan.lengths, device=dev),
                                torch.tensor(plan.sample_input, device=dev),
                                torch.tensor(plan.signature, device=dev))
    values = torch.stack(list(stats.values())).tolist()  # the one host copy
    out.update(dict(zip(stats, values)))
    out["collapse/inputs"], out["collapse/samples"] = float(plan.shape[1]), float(plan.shape[0])
    return out
