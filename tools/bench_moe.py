"""Mixture-of-experts actor benchmark (docs/moe.md), measured side by side in one run on CPU.

Tokens/s of one actor RL step (old-policy pass + update) of the tiny Qwen3-MoE preset
(8 experts, top-2, expert FFN 32) against a dense Qwen3 with the same *active* parameters per
token (FFN 64 = 2 x 32, everything else equal), both on one process; and the MoE actor at EP1 vs
EP2 on two processes (DP2, experts split over the two ranks at EP2).

    python tools/bench_moe.py [--seqs 16 --seq-len 64 --steps 3]

The routing-replay table (one process): the embedded engine generates in bf16 with the
routed experts of every token, the actor (fp32, same weights by weight sync) computes the old
log-probs with ``actor.routing_replay`` none / r2 / r3; ``mismatch_*`` is
``rollout/logp_mismatch_mean`` (mean |engine logp - actor old logp| over response tokens). R2
does not touch the old-logp pass (its mismatch is none's); what it changes is the update: after
one optimizer step the update's forward routes some tokens elsewhere than the old pass did
(``r2_flips``: fraction of token x layer top-k sets that changed), and ``update_gap_free`` /
``update_gap_r2`` are mean |logp - old logp| of that forward without / with replay.
``mismatch_dense`` is the same measurement on the dense twin (no routing at all): the bf16
rounding floor that replaying expert ids cannot remove.

The last line is ``bench_moe: moe_over_dense=<ratio> ep2_over_ep1=<ratio> mismatch_none=<x>
mismatch_r2=<x> mismatch_r3=<x>``.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl.parallel.launch import spawn


def _dense_twin(moe):
    """A dense Qwen3 with ``moe``'s active parameters per token (FFN = top_k x expert FFN)."""
    return moe.replace(family="qwen3", num_experts=0, num_experts_per_tok=0,
                       moe_intermediate_size=0,
                       intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size)


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
    cfg = moe if kind == "moe" else _dense_twin(moe)
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


def _mismatch_worker(seqs: int, new_tokens: int, lr: float) -> dict:
    """The mismatch table on one process (see the module docstring)."""
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.routing_replay import KEY, new_record_buffer
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.metrics.update import logp_mismatch
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.collect import pad_records
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sync import sync_weights

    runtime.init_parallel(timeout_s=300)
    cfg = get_preset("tiny-qwen3-moe")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 12, (seqs,), generator=g)]
    out: dict[str, float] = {}
    for mode in ("none", "r2", "r3", "dense"):
        model = cfg if mode != "dense" else _dense_twin(cfg)  # the bf16 floor without routing
        actor = Actor(model, ActorConfig(micro_batch_size=seqs // 2, mini_batch_size=seqs // 2,
                                         routing_replay=mode if mode != "dense" else "none"),
                      OptimConfig(lr=lr), LossConfig.for_algorithm("dapo"), total_steps=2,
                      seed=1)
        engine = EmbeddedEngine(model, eos_id=1, pad_id=0, return_routed_experts=mode != "dense")
        sync_weights(actor, engine, 64, version=0)  # fp32, verified; then the engine in bf16
        engine.model.to(torch.bfloat16)
        comps = [c for grp in engine.generate(prompts, SamplingParams(
            n=1, max_new_tokens=new_tokens), seed=0) for c in grp]
        records = [{"prompt_ids": c.prompt_ids, "response_ids": c.response_ids,
                    "logprobs": c.logprobs, "routed_experts": c.routed_experts,
                    "reward": float(i % 2), "acc": float(i % 2)} for i, c in enumerate(comps)]
        batch = pad_records(records, 0, 2)
        adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(records))])
        batch["advantages"] = adv[:, None] * batch["mask"]
        actor.add_old_logprobs(batch)
        out[f"mismatch_{mode}"] = logp_mismatch(batch)["rollout/logp_mismatch_mean"]
        if mode == "r2":  # the update: one optimizer step, then the second mini-batch's forward
            actor.update(batch, 0)
            now = new_record_buffer(batch, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            m = batch["mask"]
            free = actor.logprobs({**batch, KEY: now}, compute_entropy=False,
                                  routing="record")["logp"]
            replay = actor.logprobs(batch, compute_entropy=False, routing="replay")["logp"]
            valid = batch[KEY] >= 0
            same = now.sort(-1).values == batch[KEY].sort(-1).values
            out["r2_flips"] = float(1 - same.all(-1)[valid.all(-1)].float().mean())
            out["update_gap_free"] = float(((free - batch["old_logp"]).abs() * m).sum() / m.sum())
            out["update_gap_r2"] = float(((replay - batch["old_logp"]).abs() * m).sum()
                                         / m.sum())
        del actor, engine
    runtime.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mismatch-seqs", type=int, default=8)
    ap.add_argument("--mismatch-tokens", type=int, default=24)
    ap.add_argument("--mismatch-lr", type=float, default=1e-4, help="the R2 update's lr")
    ap.add_argument("--mismatch-only", action="store_true", help="only the routing-replay table")
    a = ap.parse_args()
    mm = spawn(_mismatch_worker, 1, (a.mismatch_seqs, a.mismatch_tokens,
                                             a.mismatch_lr))[0]
    print("routing replay, bf16 engine vs fp32 actor (tiny-qwen3-moe): " +
          " ".join(f"{k}={v:.4g}" for k, v in mm.items()))
    if a.mismatch_only:
        return
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
          f"mismatch_none={mm['mismatch_none']:.4g} mismatch_r2={mm['mismatch_r2']:.4g} "
          f"mismatch_r3={mm['mismatch_r3']:.4g}")


if __name__ == "__main__":
    main()
