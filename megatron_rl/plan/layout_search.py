"""The layout search: every TP x PP x CP x DP (x EP for MoE models, whose CP is 1) split of N
GPUs (x recompute settings), ranked by fit, then estimated step time, then memory per GPU."""

from __future__ import annotations

import dataclasses

from megatron_rl.plan.inputs import GIB, RECOMPUTE, PlanError, PlanInputs
from megatron_rl.plan.report import Plan, _fmt_s, make_plan
from megatron_rl.util.progress import progress


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(x: PlanInputs, gpus: int, max_tp: int = 8,
           recompute: tuple[str, ...] = RECOMPUTE, max_cp: int = 8) -> list[Plan]:
    """Every TP x PP x CP x DP (x EP for an MoE model) x recompute layout of ``gpus`` actor GPUs
    the model can split into, fitting ones first, then by estimated step time, then by memory.
    EP takes megatron-core's rules: it divides ``num_experts`` and the ``tp x dp`` ranks of a
    stage. CP (up to ``max_cp``) is searched for dense models (CP runs with EP 1)."""
    global_mini = x.n_micro * x.micro_batch_size * x.dp  # sequences per optimizer step
    cps = [1] if x.model.is_moe else [c for c in _divisors(gpus) if c <= max_cp]
    layouts = [(tp, pp, cp, gpus // (tp * pp * cp)) for tp in _divisors(gpus)
               for pp in _divisors(gpus // tp) for cp in cps if (gpus // (tp * pp)) % cp == 0]
    plans = []
    for tp, pp, cp, dp in progress(layouts, "plan search", unit="layouts", min_s=2.0):
        if tp > max_tp or global_mini % dp or x.responses_per_step % dp:
            continue
        local = global_mini // dp
        if local % x.micro_batch_size:
            continue
        eps = [e for e in _divisors(tp * dp) if x.model.num_experts % e == 0] \
            if x.model.is_moe else [1]
        for ep in eps:
            for rc in recompute:
                cand = dataclasses.replace(x, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, recompute=rc,
                                           n_micro=local // x.micro_batch_size)
                try:
                    plans.append(make_plan(cand))
                except PlanError:
                    continue
    return sorted(plans, key=lambda p: (not p.fits, sum(p.seconds.values()), p.actor_total))


def format_search(plans: list[Plan], top: int = 15) -> str:
    """A ranked table of layouts."""
    w = max([16] + [len(p.layout) + 1 for p in plans[:top]])
    lines = [f"{'rank':>4} {'layout':<{w}} {'recompute':<10} {'actor GiB/GPU':>14} "
             f"{'fits':>5} {'step time':>10}"]
    for i, p in enumerate(plans[:top], 1):
        lines.append(f"{i:>4} {p.layout:<{w}} {p.inputs.recompute:<10} "
                     f"{p.actor_total / GIB:>14.2f} {'yes' if p.fits else 'no':>5} "
                     f"{_fmt_s(sum(p.seconds.values())):>10}")
    if len(plans) > top:
        lines.append(f"... {len(plans) - top} more")
    return "\n".join(lines)
