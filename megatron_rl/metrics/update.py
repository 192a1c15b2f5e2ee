"""Per-step metrics of the policy update and of the training/inference mismatch.

- :func:`aggregate_updates`: one RL step runs ``ppo_epochs x mini-batches`` optimizer steps; its
  logged metrics are token-weighted means over all of them (not the last mini-batch's), with the
  mini-batches and the skipped ones counted.
- :func:`logp_mismatch`: per-token ``|rollout logp - actor old logp|`` (mean and max over the
  step's valid response tokens, all DP ranks), the number users watch for a drifting engine.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

TOKENS = "actor/tokens"
SKIPPED = "actor/skipped"
# aggregated other than by a token-weighted mean
_SPECIAL = (TOKENS, SKIPPED, "actor/lr", "actor/grad_norm")


def aggregate_updates(history: list[dict[str, float]]) -> dict[str, float]:
    """One dict for the whole RL step from the per-mini-batch metrics (last pipeline stage).

    Token-weighted means (weight ``actor/tokens``) over the mini-batches that were not skipped
    (over all of them when every one was skipped); ``actor/grad_norm`` is the mean over the
    applied steps; ``actor/lr`` the last; ``actor/skipped`` and ``actor/minibatches`` counts;
    ``actor/tokens`` the sum; keys ending in ``_max`` / ``_min`` (per-mini-batch extremes) the
    extreme over the mini-batches. Keys present in only some mini-batches (the entropy-dynamics
    diagnostic of the first epoch) are averaged over those."""
    if not history:
        return {}
    ok = [h for h in history if not h.get(SKIPPED, 0.0)]
    pool = ok or history
    out: dict[str, float] = {}
    keys = sorted({k for h in history for k in h if k not in _SPECIAL})
    for key in keys:
        vals = [float(h[key]) for h in pool if key in h]
        if key.endswith(("_max", "_min")) and vals:  # extremes of the step, not a mean of them
            out[key] = max(vals) if key.endswith("_max") else min(vals)
            continue
        num = den = 0.0
        for h in pool:
            if key in h:
                w = float(h.get(TOKENS, 1.0)) or 1.0
                num, den = num + w * float(h[key]), den + w
        if den:
            out[key] = num / den
    norms = [float(h["actor/grad_norm"]) for h in ok if "actor/grad_norm" in h]
    out["actor/grad_norm"] = sum(norms) / len(norms) if norms else math.nan
    if "actor/lr" in history[-1]:
        out["actor/lr"] = float(history[-1]["actor/lr"])
    out[SKIPPED] = float(sum(float(h.get(SKIPPED, 0.0)) for h in history))
    out["actor/minibatches"] = float(len(history))
    out[TOKENS] = float(sum(float(h.get(TOKENS, 0.0)) for h in history))
    return out


def logp_mismatch(local: dict) -> dict[str, float]:
    """``rollout/logp_mismatch_mean`` / ``_max`` over valid response tokens of all DP ranks, on
    the last pipeline stage (where ``old_logp [N, S]`` lives; ``{}`` elsewhere). ``rollout_logp``
    ``[N, S]`` is the engine's log-prob of each sampled token at the rollout temperature."""
    if "old_logp" not in local or "rollout_logp" not in local:
        return {}
    from megatron.core import parallel_state as ps

    old = local["old_logp"]
    dev = old.device
    m = local["mask"].to(dev).bool()
    diff = torch.where(m, (local["rollout_logp"].to(dev).double() - old.double()).abs(), 0.0)
    sums = torch.stack([diff.sum(), m.sum().double()])
    top = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=dev)
    group = ps.get_data_parallel_group()
    dist.all_reduce(sums, group=group)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return {"rollout/logp_mismatch_mean": float(sums[0] / sums[1].clamp_min(1)),
            "rollout/logp_mismatch_max": float(top)}
