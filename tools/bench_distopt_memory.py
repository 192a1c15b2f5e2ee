"""Per-rank optimizer-state memory with and without ``optim.use_distributed_optimizer``.

One spawned TP1 x PP1 x DP``--dp`` job per precision builds the actor with the standard and with
the distributed optimizer, takes one RL step (so Adam's state exists) and counts, on each rank,
the bytes of every tensor the optimizer owns beyond the model's own weights: the torch optimizer
state (``exp_avg``, ``exp_avg_sq``, ``step``) and, in bf16/fp16, the fp32 main weights. Exact
tensor sizes, not process memory: the model weights and gradient buffer are the same either way.

    python tools/bench_distopt_memory.py --dp 2 --preset tiny
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from megatron_rl.parallel.launch import spawn  # noqa: E402


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the torch optimizers' state tensors plus the separate fp32 main weights of a
    bf16/fp16 actor (the fp32 actor's main weights are its model weights, or views into them)."""
    total = 0
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        total += _nbytes(t for state in o.optimizer.state.values() for t in state.values())
        mains = getattr(o, "fp32_from_float16_groups", None) or \
            getattr(o, "shard_fp32_from_float16_groups", [])
        total += _nbytes(m for group in mains for m in group)
    return total


def _worker(dp: int, preset: str, precision: str) -> dict:
    from test_actor_checkpoint import _train
    from test_actor_layout import GLOBAL_SEQS, loss_config

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=dp, timeout_s=300)
    out = {}
    for dist_opt in (False, True):
        actor = Actor(get_preset(preset),
                      ActorConfig(micro_batch_size=max(1, GLOBAL_SEQS // dp // 2),
                                  precision=precision),
                      OptimConfig(lr=1e-3, use_distributed_optimizer=dist_opt), loss_config(),
                      total_steps=1, seed=7)
        _train(actor, dp, 0, 1, None, None)
        out["params"] = sum(p.numel() for p in actor.model.parameters())
        out[dist_opt] = optimizer_state_bytes(actor.optimizer)
    runtime.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    args = ap.parse_args()
    for precision in args.precisions:
        ranks = spawn(_worker, args.dp, (args.dp, args.preset, precision), timeout_s=600)
        n = ranks[0]["params"]
        for rank, r in enumerate(ranks):
            std, dist = r[False], r[True]
            print(f"{args.preset} ({n} params) {precision} DP{args.dp} rank {rank}: optimizer "
                  f"state {std / 2**20:.3f} MiB standard, {dist / 2**20:.3f} MiB distributed "
                  f"({dist / std:.3f}x)")


if __name__ == "__main__":
    main()
