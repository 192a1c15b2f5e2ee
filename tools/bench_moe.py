"""Mixture-of-experts actor benchmark (docs/moe.md), measured side by side in one run on CPU.

Tokens/s of one actor RL step (old-policy pass + update) of the tiny Qwen3-MoE preset
(8 experts, top-2, expert FFN 32) against a dense Qwen3 with the same *active* parameters per
token (FFN 64 = 2 x 32, everything else equal), both on one process; and the MoE actor at EP1 vs
EP2 on two processes (DP2, experts split over the two ranks at EP2).

    python tools/bench_moe.py [--seqs 16 --seq-len 64 --steps 3]

Routing replay (the issue's mismatch table) is not implemented; its fields print ``n/a``.
The last line is ``bench_moe: moe_over_dense=<ratio> ep2_over_ep1=<ratio> mismatch_none=n/a
mismatch_r2=n/a mismatch_r3=n/a``.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl.parallel.launch import spawn


def _worker(kind: str, ep: int, seqs: int, seq_len: int, steps: int) -> float:
    """Mean seconds of one RL step (after a warm-up step) on this layout."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.cli.check import make_batch
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(ep=ep, timeout_s=300)
    moe = get_preset("tiny-qwen3-moe")
    cfg = moe if kind == "moe" else moe.replace(
        family="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
        intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size)
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = seqs // dp
    actor = Actor(cfg, ActorConfig(micro_batch_size=local), OptimConfig(lr=1e-4),
                  LossConfig.for_algorithm("dapo"), total_steps=steps + 1, seed=1)
    times = []
    for step in range(steps + 1):  # step 0 is warm-up
        (mb,) = make_batch(1, seqs, seq_len, cfg.vocab_size, seed=step)
        batch = {k: v[r * local:(r + 1) * local] for k, v in mb.items()}
        adv = torch.randn(seqs, 1, generator=torch.Generator().manual_seed(step))
        batch["advantages"] = adv[r * local:(r + 1) * local] * batch["mask"]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        actor.add_old_logprobs(batch)
        actor.update(batch, step)
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    runtime.shutdown()
    return sum(times) / len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    tokens = a.seqs * a.seq_len
    args = (a.seqs, a.seq_len, a.steps)
    rows = [("dense (same active params), 1 proc", spawn(_worker, 1, ("dense", 1, *args))[0]),
            ("moe EP1, 1 proc", spawn(_worker, 1, ("moe", 1, *args))[0]),
            ("moe EP1, DP2", spawn(_worker, 2, ("moe", 1, *args))[0]),
            ("moe EP2, DP2", spawn(_worker, 2, ("moe", 2, *args))[0])]
    print(f"{'layout':<38} {'step s':>8} {'tokens/s':>10}")
    for name, s in rows:
        print(f"{name:<38} {s:8.3f} {tokens / s:10.0f}")
    moe_over_dense = rows[0][1] / rows[1][1]  # tokens/s ratio = inverse time ratio
    ep2_over_ep1 = rows[2][1] / rows[3][1]
    print(f"bench_moe: moe_over_dense={moe_over_dense:.3f} ep2_over_ep1={ep2_over_ep1:.3f} "
          "mismatch_none=n/a mismatch_r2=n/a mismatch_r3=n/a")


if __name__ == "__main__":
    main()
