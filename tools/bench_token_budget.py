"""Token-budget micro-batches vs row-count micro-batches: one actor RL step (old-policy pass +
update), side by side in one run on gloo CPU processes.

Rows: ``--rows`` responses on a long-tailed length distribution with a cap of ``--cap`` tokens
(70 % log-normal around 20 % of the cap, 20 % uniform over the cap, 10 % at the cap; 8-token
prompts). ``padded``: ``actor.micro_batch_size`` rows per micro-batch, all padded to the step's
longest row (today's default). ``budget``: ``actor.max_tokens_per_micro_batch`` = the same
micro-batch in tokens (``micro_batch_size x`` the padded length), each micro-batch padded to its
own longest row; with ``--pp 2`` the pipeline sends each micro-batch's shape first
(``variable_seq_lengths``). The two alternate step by step; the median step time is reported.

    python tools/bench_token_budget.py --pp 1
    python tools/bench_token_budget.py --pp 2

Last line: ``bench_token_budget: step_ratio=<budget/padded> pad_fraction_budget=<x>
pad_fraction_padded=<y>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_rl.parallel.launch import spawn

PROMPT = 8


def lengths(rows: int, cap: int, seed: int = 0) -> list[int]:
    """Response lengths: 70 % log-normal (median 20 % of the cap), 20 % uniform, 10 % at the cap."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        u = i % 10
        if u == 9:
            n = cap
        elif u >= 7:
            n = int(torch.randint(1, cap + 1, (1,), generator=g))
        else:
            n = int(0.2 * cap * float(torch.exp(0.5 * torch.randn(1, generator=g))))
        out.append(max(1, min(cap, n)))
    return out


def make_batch(rows: int, cap: int) -> dict:
    resp = lengths(rows, cap)
    seq = PROMPT + cap
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq, dtype=torch.bool)
    for i, n in enumerate(resp):
        mask[i, PROMPT:PROMPT + n] = True
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _worker(pp: int, rows: int, cap: int, micro: int, steps: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=pp, dp=1, timeout_s=300)
    budget = micro * (PROMPT + cap)
    actors = {name: Actor(get_preset("tiny"), ActorConfig(
        micro_batch_size=micro, max_tokens_per_micro_batch=b), OptimConfig(lr=1e-4),
        LossConfig.for_algorithm("dapo"), total_steps=steps + 1, seed=3)
        for name, b in (("padded", 0), ("budget", budget))}
    times: dict[str, list[float]] = {k: [] for k in actors}
    pads: dict[str, float] = {}
    for step in range(steps + 1):  # step 0 warms up
        for name, actor in actors.items():
            batch = make_batch(rows, cap)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            actor.add_old_logprobs(batch)
            hist = actor.update(batch, step)
            torch.distributed.barrier()
            if step:
                times[name].append(time.perf_counter() - t0)
            if hist and "actor/pad_fraction" in hist[-1]:  # the last stage's metrics
                pads[name] = hist[-1]["actor/pad_fraction"]
    out = {k: statistics.median(v) for k, v in times.items()}
    last = ps.is_pipeline_last_stage()
    runtime.shutdown()
    return {"times": out, "pads": pads} if last else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--cap", type=int, default=384)
    ap.add_argument("--micro", type=int, default=4, help="actor.micro_batch_size (padded)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    res = [r for r in spawn(_worker, a.pp, (a.pp, a.rows, a.cap, a.micro, a.steps),
                            timeout_s=1800) if r][0]
    resp = lengths(a.rows, a.cap)
    print(f"rows {a.rows}, cap {a.cap} (+{PROMPT} prompt), mean response "
          f"{sum(resp) / len(resp):.0f} = {sum(resp) / len(resp) / a.cap:.0%} of the cap; "
          f"TP1xPP{a.pp}, tiny preset, CPU gloo, median of {a.steps} steps")
    for k in ("padded", "budget"):
        print(f"  {k:<8} step {res['times'][k]:7.3f} s  pad fraction {res['pads'][k]:.3f}")
    ratio = res["times"]["budget"] / res["times"]["padded"]
    print(f"bench_token_budget: step_ratio={ratio:.3f} pad_fraction_budget="
          f"{res['pads']['budget']:.3f} pad_fraction_padded={res['pads']['padded']:.3f}")


if __name__ == "__main__":
    main()
