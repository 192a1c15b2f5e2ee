"""LoRA vs full fine-tuning on one model: optimizer-state bytes, peak memory, weight-sync bytes.

Two fresh single-rank jobs (one per mode, so each process's peak memory is its own) build the
actor on ``--preset`` with a KL loss (full fine-tuning holds a reference copy; LoRA uses the base
with adapters off), take ``--steps`` RL steps on a random batch, and report:

- ``optim_bytes``: every tensor the optimizer owns (Adam moments, step, fp32 main weights of a
  bf16 actor): exact sizes;
- ``peak_mem``: peak CUDA memory allocated (GPU) or the process's peak RSS (CPU, which includes
  the Python/torch runtime both modes share, so the CPU ratio understates the saving);
- ``sync_bytes``: the merged weight sync (every HF tensor, what every sync strategy sends) vs an
  adapter-only sync (``actor.lora.sync: adapter``: the PEFT adapter file's tensors in the actor's
  dtype, what each sync after the first loads into the servers).

    python tools/bench_lora.py --preset tiny --rank 16 [--precision bf16]

Last line: ``bench_lora: optim_bytes_ratio=… peak_mem_ratio=… sync_bytes_ratio=…`` (LoRA / full
for the first two, adapter-only / merged for the third).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_rl.parallel.launch import spawn  # noqa: E402

SEQS, SEQ = 8, 64


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors plus separate fp32 main weights."""
    total = 0
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        total += _nbytes(t for state in o.optimizer.state.values() for t in state.values())
        mains = getattr(o, "fp32_from_float16_groups", None) or \
            getattr(o, "shard_fp32_from_float16_groups", [])
        total += _nbytes(m for group in mains for m in group)
    return total


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (SEQS, SEQ), generator=g)
    mask = torch.zeros(SEQS, SEQ, dtype=torch.bool)
    mask[:, SEQ // 2:] = True
    adv = torch.linspace(-1, 1, SEQS)[:, None].expand(SEQS, SEQ) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _worker(preset: str, rank: int, precision: str | None, steps: int) -> dict:
    from _bench_common import rss_kib

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.convert.lora_export import peft_tensors
    from megatron_rl.convert.stream import iter_hf_weight_buckets
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.models.lora import gather_full_adapters
    from megatron_rl.models.lora_config import LoraConfig
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=600)
    cfg = get_preset(preset)
    actor = Actor(cfg, ActorConfig(micro_batch_size=SEQS // 2, precision=precision,
                                   lora=LoraConfig(rank=rank, alpha=2.0 * rank) if rank else
                                   LoraConfig()),
                  OptimConfig(lr=1e-4), LossConfig.for_algorithm("dapo", use_kl_loss=True,
                                                                 kl_loss_coef=0.01),
                  total_steps=steps, seed=1)
    batch = _batch(cfg.vocab_size)
    for step in range(steps):
        b = dict(batch)
        actor.add_old_logprobs(b)
        actor.add_ref_logprobs(b)
        actor.update(b, step)
    merged = sum(_nbytes(t for _, t in bucket) for bucket in iter_hf_weight_buckets(actor.model))
    dtype = next(p.dtype for p in actor.model.parameters())  # what the adapter sync writes
    adapter = _nbytes(t.to(dtype) for t in peft_tensors(gather_full_adapters(actor.model),
                                                        cfg).values()) if rank else 0
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else rss_kib("VmHWM") * 1024)
    out = {"optim_bytes": optimizer_bytes(actor.optimizer), "peak_mem": peak,
           "merged_sync_bytes": merged, "adapter_sync_bytes": adapter,
           "trainable": sum(p.numel() for p in actor.model.parameters() if p.requires_grad)}
    runtime.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--precision", default=None, help="bf16 | fp16 | fp32 (default: by device)")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    full = spawn(_worker, 1, (a.preset, 0, a.precision, a.steps), timeout_s=1800)[0]
    lora = spawn(_worker, 1, (a.preset, a.rank, a.precision, a.steps), timeout_s=1800)[0]
    for name, r in (("full", full), (f"lora r={a.rank}", lora)):
        print(f"{name:>10}: trainable={r['trainable']:,} optim_bytes={r['optim_bytes']:,} "
              f"peak_mem={r['peak_mem']:,} merged_sync_bytes={r['merged_sync_bytes']:,} "
              f"adapter_sync_bytes={r['adapter_sync_bytes']:,}")
    print(f"bench_lora: optim_bytes_ratio={lora['optim_bytes'] / full['optim_bytes']:.4f} "
          f"peak_mem_ratio={lora['peak_mem'] / full['peak_mem']:.4f} "
          f"sync_bytes_ratio={lora['adapter_sync_bytes'] / lora['merged_sync_bytes']:.4f}")


if __name__ == "__main__":
    main()
