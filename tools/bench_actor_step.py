"""Per-step wall time and peak RSS per rank of one actor RL step (old-policy pass + update) at
several TP x PP x DP layouts, measured in one run on gloo processes.

    python tools/bench_actor_step.py --layouts 1x1x1 2x1x1 1x2x1 2x2x1 1x1x2 --steps 3
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from megatron_rl.parallel.launch import spawn


def _worker(tp: int, pp: int, dp: int, seqs: int, seq_len: int, steps: int, preset: str,
            loss: str) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.check import make_batch
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=300)
    cfg = get_preset(preset)
    local = seqs // dp
    actor = Actor(cfg, ActorConfig(micro_batch_size=max(1, local // 2)), OptimConfig(lr=1e-4),
                  LossConfig.for_algorithm(loss), total_steps=steps + 1, seed=1)
    times = []
    for step in range(steps + 1):  # step 0 is warm-up
        (mb,) = make_batch(1, seqs, seq_len, cfg.vocab_size, seed=step)
        r = ps.get_data_parallel_rank()
        batch = {k: v[r * local:(r + 1) * local] for k, v in mb.items()}
        g = torch.Generator().manual_seed(step)
        batch["advantages"] = torch.randn(seqs, 1, generator=g)[r * local:(r + 1) * local] * \
            batch["mask"]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        actor.add_old_logprobs(batch)
        actor.update(batch, step)
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB (Linux: KiB)
    runtime.shutdown()
    return {"step_s": sum(times) / len(times), "rss_mib": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layouts", nargs="+", default=["1x1x1", "2x1x1", "1x2x1", "2x2x1", "1x1x2"],
                   help="TPxPPxDP layouts")
    p.add_argument("--seqs", type=int, default=8, help="sequences per RL step (global)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--model", default="tiny")
    p.add_argument("--loss", default="dapo")
    a = p.parse_args()
    print(f"model={a.model} loss={a.loss} batch={a.seqs}x{a.seq_len} steps={a.steps} "
          f"(+1 warm-up); old-policy pass + update per step; 1 thread per rank")
    print(f"{'layout':>8} {'ranks':>5} {'s/step':>8} {'peak RSS/rank (MiB)':>20}")
    for lay in a.layouts:
        tp, pp, dp = (int(x) for x in lay.split("x"))
        res = spawn(_worker, tp * pp * dp, (tp, pp, dp, a.seqs, a.seq_len, a.steps, a.model,
                                            a.loss), timeout_s=900)
        print(f"{lay:>8} {tp * pp * dp:>5} {max(r['step_s'] for r in res):>8.3f} "
              f"{max(r['rss_mib'] for r in res):>20.0f}", flush=True)


if __name__ == "__main__":
    main()
