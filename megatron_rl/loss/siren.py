"""SIREN, selective entropy regularisation (arXiv 2509.25133, "Rethinking Entropy Regularization
in Large Reasoning Models"), as a term added to any policy loss (``siren_coef > 0``)::

    S      = the valid tokens whose entropy is above the siren_quantile quantile of the
             mini-batch's valid-token entropies (the peak-entropy position mask)
    H_S    = sum_{t in S} H_t / |S|                 (mean entropy of the selected tokens)
    L_reg  = siren_coef * (H_S - H_anchor)^2        (self-anchored: H_anchor is the model's own
                                                     H_S over the first RL step's batch)

The quantile is global: the selected set is the top ``|valid| - 1 - floor(q (|valid| - 1))``
tokens by entropy over every micro-batch and every DP rank (what ``x > nanquantile(x, q)`` selects
when no two entropies tie at the threshold; ties go to the smaller global token index), found by
the exact radix selection of Clip-Cov (:func:`megatron_rl.loss.select.global_topk_mask`). ``H_S``
needs the whole mini-batch before any backward: the trainer computes it from the current weights'
entropies (``old_entropy`` for the first update of a step, a no-grad pre-pass for later ones), and
each micro-batch adds ``coef * ((H_S - a)^2 |S_m| / |S| + 2 (H_S - a) sum_{t in S_m}(H_t -
sg(H_t)) / |S|)``: summed over micro-batches and ranks this is ``L_reg`` in value and gradient.

Reference code: Linn3a/siren@fa59a8dfbecf5c3936ed905d5902a06c0ca425ee:
``verl/verl/workers/actor/dp_actor.py`` (``mask_by_quantile``, ``efficient_top_p_sampling``,
experiment_type ``siren``: ``(entropy_loss - entropy_anchor)^2 * entropy_coeff`` added to the PPO
loss) and ``verl/verl/trainer/ppo/ray_trainer.py`` (the anchor: the first step's selected
entropy of the whole batch, kept for the run); ``exp_scripts/siren.sh`` (coef 0.005, quantile
0.8, top-p 0.8, clip 0.28). Read, not copied.

Deliberate differences (read before comparing numbers with the paper):

* **Top-p vocabulary mask** (``siren_top_p``; 1 = off, the authors' ``abla_wo_topp``): the
  paper's first mask renormalises each position's distribution over its top-p nucleus before
  taking the entropy; with ``siren_top_p < 1`` the actor's head computes every entropy that way
  (:mod:`megatron_rl.ops.top_p_entropy`: the nucleus threshold searched over the TP-sharded
  vocabulary with all-reduces, no sort, no gather, no host sync), so ``H_t`` here is that.
* Scope of the quantile and of ``H_S``: the reference takes the quantile per response row
  (``nanquantile(..., dim=-1)``) and averages per micro-batch (``seq-mean-token-mean``); here both
  are over the whole mini-batch (token mean over ``S``), the same for any layout.
* The anchor is taken from the first RL step (the old-policy pass of its whole batch) and saved
  with the checkpoints (a resumed run keeps it), unless ``siren_anchor`` fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_rl.loss.context import ReductionContext, as_list
from megatron_rl.loss.params import LossParams
from megatron_rl.loss.select import (
    composite_key,
    float_order_key,
    global_token_index,
    global_topk_mask,
)

Tensor = torch.Tensor


@dataclass
class SirenSelection:
    """Selected-token masks (one ``[B_m, T_m]`` bool per local micro-batch), the global selected
    count ``n_sel`` (0-dim fp64) and mean entropy ``h_sel`` (0-dim fp64), all on the device."""

    selected: list[Tensor]
    n_sel: Tensor
    h_sel: Tensor


@dataclass
class SirenTerm:
    """What one micro-batch's loss needs: its ``selected`` mask ``[B, T]`` and the mini-batch's
    ``gap = H_S - H_anchor`` and ``n_sel = |S|`` (0-dim fp64 each)."""

    selected: Tensor
    gap: Tensor
    n_sel: Tensor


def selection_size(n_valid: Tensor, quantile: float) -> Tensor:
    """``|S| = N - 1 - floor(q (N - 1))`` for ``N`` valid tokens (0-dim int64; 0 when N = 0)."""
    n = n_valid.to(torch.int64)
    below = torch.floor(quantile * (n - 1).clamp_min(0).double()).to(torch.int64)
    return (n - 1 - below).clamp_min(0)


def siren_select(ctx: ReductionContext, cfg: LossParams, entropy: Tensor | Sequence[Tensor],
                 masks: Tensor | Sequence[Tensor]) -> SirenSelection:
    """The peak-entropy tokens of the mini-batch and their mean entropy (see module docstring).

    ``entropy``/``masks``: this rank's micro-batches ``[B_m, T_m]`` (entropies detached here).
    Collectives: the selection's (none for one process) and one ``all_reduce`` of 2 numbers.
    """
    ents = [e.detach().float() for e in as_list(entropy)]
    ms = [m.bool() for m in as_list(masks)]
    dev = ents[0].device
    index = global_token_index(ctx, [e.shape for e in ents], dev)
    keys = torch.cat([composite_key(float_order_key(e).reshape(-1), i.reshape(-1))
                      for e, i in zip(ents, index)])
    active = torch.cat([m.reshape(-1) for m in ms])
    k = selection_size(ctx.num_tokens.to(dev), cfg.siren_quantile)
    flat = global_topk_mask(keys, active, k, ctx, k_max=active.numel())
    selected, start = [], 0
    for m in ms:
        selected.append(flat[start:start + m.numel()].view(m.shape))
        start += m.numel()
    sums = torch.stack([
        sum(torch.where(s, e.double(), 0.0).sum() for s, e in zip(selected, ents)),
        flat.sum().double()])
    ctx.all_reduce(sums)
    return SirenSelection(selected, sums[1], sums[0] / sums[1].clamp_min(1.0))


def siren_loss(entropy: Tensor, term: SirenTerm, coef: float) -> Tensor:
    """This micro-batch's share of ``coef * (H_S - a)^2`` (0-dim fp32): value
    ``coef gap^2 |S_m| / |S|``, gradient ``2 coef gap sum_{t in S_m} grad H_t / |S|``."""
    sel = term.selected.bool()
    h = torch.where(sel, entropy.float(), 0.0).sum()
    n = term.n_sel.clamp_min(1.0)
    share = sel.sum().double() / n
    value = term.gap * term.gap * share
    grad_part = 2.0 * term.gap * (h - h.detach()).double() / n
    return (coef * (value + grad_part)).float()
