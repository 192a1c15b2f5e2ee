"""Checkpoint save stall: how long the training loop is blocked by checkpoint saves, with
synchronous saves and with ``trainer.async_save`` (docs/checkpoints.md), on CPU gloo ranks.

Each mode trains a small GPT actor for ``--steps`` RL updates and saves every ``--save-every``
steps. The stall of a save is the wall time the loop spends inside ``actor.save`` (for the
asynchronous mode: waiting for the previous save if it is still being written -- also printed
by itself --, planning, and snapshots of the RNG/trainer state; the host copy of the shards
runs in the writer thread during the next step). The wait for the last save at exit is printed
separately (once per run, not per save).

    python tools/bench_ckpt.py                 # about a minute on 2 CPU cores
    python tools/bench_ckpt.py --hidden 1024   # bigger checkpoint

Last line: ``bench_ckpt: stall_ratio=<async stall / sync stall>`` (mean stall per save).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from megatron_rl.parallel.launch import spawn

SEQS, SEQ = 4, 32


def _batch(step: int, vocab: int) -> dict:
    """One RL batch: prompt + response rows, per-sequence advantages (host tensors)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (SEQS, SEQ), generator=g)
    mask = torch.zeros(SEQS, SEQ, dtype=torch.bool)
    mask[:, 4:] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(SEQS, SEQ) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _actor(hidden: int, layers: int, vocab: int, steps: int):
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import ModelConfig

    cfg = ModelConfig(family="qwen2", vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=512, init_method_std=0.02)
    return Actor(cfg, ActorConfig(micro_batch_size=SEQS), OptimConfig(lr=1e-4),
                 LossConfig.for_algorithm("dapo"), total_steps=steps, seed=3)


def _worker(mode: str, root: str, hidden: int, layers: int, vocab: int, steps: int,
            save_every: int) -> dict:
    """Train ``steps`` updates, saving every ``save_every``; the stalls of the saves."""
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=600)
    actor = _actor(hidden, layers, vocab, steps)
    actor.saver.async_save = mode == "async"
    stalls, waits, step_times = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = _batch(step, vocab)
        actor.add_old_logprobs(batch)
        actor.update(batch, step)
        step_times.append(time.perf_counter() - t0)
        if (step + 1) % save_every == 0:
            t0 = time.perf_counter()
            actor.wait_for_save()  # inside actor.save too; timed apart (async: the last write)
            waits.append(time.perf_counter() - t0)
            actor.save(root, step, {"data_position": step + 1})
            stalls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    actor.wait_for_save()
    exit_wait = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    runtime.shutdown()
    return {"stalls": stalls, "waits": waits, "exit_wait": exit_wait,
            "step": statistics.median(step_times), "mib": size / 2**20 / len(stalls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    args = ap.parse_args()
    results = {}
    for mode in ("sync", "async"):
        root = tempfile.mkdtemp(prefix=f"bench_ckpt_{mode}_")
        try:
            results[mode] = spawn(_worker, 1, (mode, root, args.hidden, args.layers, args.vocab,
                                               args.steps, args.save_every), timeout_s=1800)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r = results[mode]
        print(f"{mode:5s}: checkpoint {r['mib']:.0f} MiB, step {r['step']:.3f} s (median), "
              f"stall per save {statistics.mean(r['stalls']):.3f} s "
              f"(each: {', '.join(f'{s:.3f}' for s in r['stalls'])}; of which waiting for the "
              f"previous write: {', '.join(f'{s:.3f}' for s in r['waits'])}), "
              f"wait at exit {r['exit_wait']:.3f} s", flush=True)
    ratio = statistics.mean(results["async"]["stalls"]) / statistics.mean(results["sync"]["stalls"])
    print(f"bench_ckpt: stall_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
