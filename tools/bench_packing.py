"""Sequence packing benchmark: one actor RL step (old-policy pass + DAPO update) on a long-tailed
response-length distribution, padded vs packed (and packed with a token budget when the actor has
``max_tokens_per_micro_batch``), the same rows, one process, steps alternated side by side.

Lengths (stated in the output): prompts of ``--prompt`` tokens; responses 70% log-normal around
20% of the cap (sigma 0.5), 20% uniform in [5%, 60%] of the cap, 10% at the cap. Rows are padded
to the longest row of the step (as ``rollout/collect.py`` does) for the padded path.

Per mode: tokens the model runs per step, pad fraction (padding / all tokens run), seconds per
step (median), step time ratio vs padded, peak RSS growth during a timed step (after warm-up).
"packed" is the default attention choice; on CPU also "packed, per-seq attention" and "packed,
mask attention": SDPAttention forced to its per-sequence loop / its ``[T, T]`` document-causal
mask (both exact).

    python tools/bench_packing.py                 # defaults below, a few minutes on 2 cores
    python tools/bench_packing.py --rows 16 --cap 256 --steps 2     # quick

The last line reads ``bench_packing: step_ratio=<packed/padded> pad_fraction_packed=<x>
pad_fraction_padded=<y>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import reset_peak_rss, rss_kib  # noqa: E402


def lengths(rows: int, cap: int, seed: int) -> list[int]:
    """Response lengths of the long-tailed distribution (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        u = float(torch.rand((), generator=g))
        if u < 0.1:
            n = cap
        elif u < 0.3:
            n = int(cap * (0.05 + 0.55 * float(torch.rand((), generator=g))))
        else:
            n = int(0.2 * cap * float(torch.exp(0.5 * torch.randn((), generator=g) - 0.125)))
        out.append(max(1, min(cap, n)))
    return out


def make_batch(resp: list[int], prompt: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    seq = prompt + max(resp)
    tokens = torch.randint(1, vocab, (len(resp), seq), generator=g)
    mask = torch.zeros(len(resp), seq, dtype=torch.bool)
    for b, n in enumerate(resp):
        mask[b, prompt:prompt + n] = True
        tokens[b, prompt + n:] = 0
    adv = torch.randn(len(resp), 1, generator=g).expand(-1, seq) * mask
    return {"tokens": tokens, "mask": mask, "advantages": adv.contiguous()}


def _worker(args: argparse.Namespace) -> dict:
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import LossConfig
    from megatron_rl.models.attention import SDPAttention
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=1, dp=1, timeout_s=600)
    mcfg = ModelConfig(family="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128
                       or 1, max_position_embeddings=args.prompt + args.cap)
    resp = lengths(args.rows, args.cap, args.seed)
    batch = make_batch(resp, args.prompt, args.vocab, args.seed)
    modes = {"padded": dict(pack_sequences=False), "packed": dict(pack_sequences=True)}
    if not torch.cuda.is_available():
        modes["packed, per-seq attention"] = dict(pack_sequences=True)
        modes["packed, mask attention"] = dict(pack_sequences=True)
    if "max_tokens_per_micro_batch" in {f.name for f in dataclasses.fields(ActorConfig)}:
        modes["packed + token budget"] = dict(
            pack_sequences=True, max_tokens_per_micro_batch=args.micro * (args.prompt + args.cap))
    actors = {}
    for name, kw in modes.items():
        actors[name] = Actor(mcfg, ActorConfig(micro_batch_size=args.micro, **kw),
                             OptimConfig(lr=1e-5), LossConfig.for_algorithm("dapo"),
                             total_steps=args.steps + 1, seed=1)
        if name.endswith(" attention"):  # CPU: force one SDPAttention mode (default: auto)
            for m in actors[name].model.modules():
                if isinstance(m, SDPAttention):
                    m.packed_cpu_mode = "mask" if "mask" in name else "segments"
    times: dict[str, list[float]] = {k: [] for k in modes}
    rss: dict[str, int] = {k: 0 for k in modes}
    info: dict[str, dict] = {}
    for step in range(args.steps + 1):  # step 0 warms up
        for name, actor in actors.items():
            b = {k: v.clone() for k, v in batch.items()}
            reset_peak_rss()
            base = rss_kib("VmRSS")
            t0 = time.perf_counter()
            actor.add_old_logprobs(b)
            hist = actor.update(b, step)
            dt = time.perf_counter() - t0
            if step:
                rss[name] = max(rss[name], rss_kib("VmHWM") - base)
                times[name].append(dt)
            info[name] = hist[-1]
    runtime.shutdown()
    return {"times": times, "rss": rss, "info": info, "resp": resp,
            "seq": batch["tokens"].shape[1], "params": sum(
                p.numel() for p in actors["padded"].model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--cap", type=int, default=512, help="response length cap (tokens)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4, help="actor.micro_batch_size")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from megatron_rl.parallel.launch import spawn

    (res,) = spawn(_worker, 1, (args,), timeout_s=3600)
    resp = res["resp"]
    mean = sum(resp) / len(resp)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"load avg {os.getloadavg()[0]:.1f}; model {res['params'] / 1e6:.2f}M params "
          f"(hidden {args.hidden}, {args.layers} layers), fp32")
    print(f"rows {args.rows}, micro-batch {args.micro} rows; prompt {args.prompt}, response cap "
          f"{args.cap}: mean {mean:.0f} ({mean / args.cap:.0%} of cap), max {max(resp)}, "
          f"{sum(n == args.cap for n in resp)} at the cap; padded row length {res['seq']}")
    base = statistics.median(res["times"]["padded"])
    print(f"{'mode':26s} {'tokens/step':>11s} {'pad frac':>8s} {'tok/micro':>9s} "
          f"{'s/step':>7s} {'ratio':>6s} {'peak RSS +MiB':>13s}")
    for name, ts in res["times"].items():
        m = res["info"][name]
        tpm = m["actor/tokens_per_micro_batch"]
        # tokens run = the rows' valid tokens / (1 - padding share); a token budget changes the
        # number of micro-batches, so tok/micro x rows/micro would not be it
        ran = sum(args.prompt + n for n in resp) / (1.0 - m["actor/pad_fraction"])
        med = statistics.median(ts)
        print(f"{name:26s} {ran:11.0f} {m['actor/pad_fraction']:8.3f} {tpm:9.0f} "
              f"{med:7.2f} {med / base:6.2f} {res['rss'][name] / 1024:13.0f}")
    ratio = statistics.median(res["times"]["packed"]) / base
    print(f"bench_packing: step_ratio={ratio:.3f} "
          f"pad_fraction_packed={res['info']['packed']['actor/pad_fraction']:.4f} "
          f"pad_fraction_padded={res['info']['padded']['actor/pad_fraction']:.4f}")


if __name__ == "__main__":
    main()
