"""Benchmark: vocab-parallel log-prob + entropy (ours) vs the anchors' gather + log_softmax path.

    python tools/bench_logprob_entropy.py --tokens 8192 --vocab 151936 --tp 4 --dtype bf16 \
        --chunk-size 1024

Every variant runs forward + backward (``loss = sum(g_lp * logp) + sum(g_H * H)``) in fresh
processes started by :func:`megatron_rl.parallel.launch.spawn`, so memory numbers do not leak
between variants. Measured per process:

* peak RSS increase over the post-setup baseline (logits, labels and upstream grads allocated; the
  peak counter is reset with ``/proc/self/clear_refs`` after setup, falling back to ``ru_maxrss``);
  it includes the ``[N, V_local]`` gradient in the input dtype, which every variant must produce;
* bytes saved for backward (``saved_tensors_hooks``, unique storages), split into storage that
  aliases the input logits (no extra memory) and extra storage;
* wall time of forward + backward (best of ``--repeats``).

Ours at ``--tp > 1`` runs in ``--tp`` gloo processes, each holding ``[tokens, vocab / tp]``. The
naive path at TP > 1 all-gathers the full vocabulary on every rank, so its per-rank cost is that of
one process holding the full ``[tokens, vocab]`` logits: it is measured that way (one process, the
gather buffers themselves not counted, which favours the naive path). When the naive path's
estimated peak does not fit the memory budget, it runs at the largest power-of-two token count
that fits; ours is then also run at that token count (same-shape ratio) and per-token numbers are
printed, clearly labelled.

CPU timings on a small box are indicative only: with ``--tp`` ranks on fewer cores the ranks share
the cores (threads per rank = cores // tp).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.parallel.launch import spawn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import reset_peak_rss, rss_kib  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GIB = 1024 ** 3
# Rough fp32 [N, V] buffers at the naive path's peak (z, log_softmax, softmax, product in forward;
# saved log_softmax and softmax plus ~4 gradient buffers in backward), measured at small shapes.
NAIVE_FP32_BUFFERS = 6.0


# --------------------------------------------------------------------------------------------
# Memory probes
# --------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    return rss_kib(field)


class _SavedBytes:
    """``saved_tensors_hooks`` that sums the unique storages saved for backward."""

    def __init__(self, input_tensor: torch.Tensor):
        self.input_storage = input_tensor.untyped_storage().data_ptr()
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[st.data_ptr()] = st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def split(self) -> tuple[int, int]:
        """(bytes aliasing the input, extra bytes)."""
        alias = self.storages.get(self.input_storage, 0)
        return alias, sum(self.storages.values()) - alias


# --------------------------------------------------------------------------------------------
# Worker (one process per rank)
# --------------------------------------------------------------------------------------------
def _bench_worker(variant: str, tokens: int, vocab: int, tp: int, dtype: str,
                  chunk_size: int | None, temperature: float, repeats: int) -> dict:
    import torch.distributed as dist

    from megatron_rl.ops import naive_logprob_entropy, vocab_parallel_logprob_entropy

    group, rank = None, 0
    if variant == "ours" and tp > 1:
        from megatron_rl.parallel.runtime import init_distributed

        init_distributed(backend="gloo", timeout_s=1800)
        group, rank = dist.group.WORLD, dist.get_rank()
    v_local = vocab // tp if variant == "ours" else vocab

    g = torch.Generator().manual_seed(1234 + rank)
    logits = torch.randn(tokens, v_local, generator=g, dtype=DTYPES[dtype]).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    g_lp, g_h = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)

    def step() -> None:
        if variant == "ours":
            logp, entropy = vocab_parallel_logprob_entropy(
                logits, labels, group, temperature=temperature, chunk_size=chunk_size)
        else:
            logp, entropy = naive_logprob_entropy(logits, labels, None, temperature)
        ((logp * g_lp).sum() + (entropy * g_h).sum()).backward()

    gc.collect()
    if group is not None:
        dist.barrier(group)
    hwm_ok = reset_peak_rss()
    base_kib = _rss_kib("VmRSS") if hwm_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    saved = _SavedBytes(logits)
    t0 = time.perf_counter()
    with saved.hooks():
        step()
    times = [time.perf_counter() - t0]
    peak_kib = _rss_kib("VmHWM") if hwm_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(repeats - 1):
        logits.grad = None
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    alias, extra = saved.split()
    return dict(peak_increase=(peak_kib - base_kib) * 1024, saved_alias=alias, saved_extra=extra,
                time=min(times), times=times, rank=rank, v_local=v_local,
                peak_source="VmHWM (reset after setup)" if hwm_ok else "ru_maxrss")


def _run(variant: str, tokens: int, args, tp: int) -> dict:
    world = tp if variant == "ours" else 1
    threads = max(1, (os.cpu_count() or 1) // world)
    per_rank = spawn(_bench_worker, world,
                     (variant, tokens, args.vocab, tp, args.dtype, args.chunk_size,
                      args.temperature, args.repeats),
                     timeout_s=3600, env={"MRL_THREADS_PER_RANK": str(threads)})
    return dict(variant=variant, tokens=tokens, world=world, threads=threads,
                v_local=per_rank[0]["v_local"],
                peak=max(r["peak_increase"] for r in per_rank),
                peak_sum=sum(r["peak_increase"] for r in per_rank),
                saved_alias=per_rank[0]["saved_alias"], saved_extra=per_rank[0]["saved_extra"],
                time=max(r["time"] for r in per_rank), source=per_rank[0]["peak_source"])


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def naive_estimate(tokens: int, vocab: int, dtype: str) -> int:
    """Estimated naive peak bytes: input + grad (input dtype) + NAIVE_FP32_BUFFERS fp32 buffers."""
    item = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    return int(tokens * vocab * (2 * item + 4 * NAIVE_FP32_BUFFERS))


def _fmt(r: dict) -> str:
    return (f"{r['variant']:<6} tokens={r['tokens']:<6} procs={r['world']} "
            f"[N, V_local]=[{r['tokens']}, {r['v_local']}]  "
            f"peak RSS increase/rank {r['peak'] / GIB:7.3f} GiB  "
            f"saved for backward: extra {r['saved_extra'] / GIB:7.3f} GiB"
            f" (+{r['saved_alias'] / GIB:.3f} GiB aliasing the input)  "
            f"fwd+bwd {r['time']:7.2f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="rows per chunk for our op (default: all rows at once)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs (best is reported)")
    ap.add_argument("--mem-budget-gib", type=float, default=None,
                    help="memory the naive path may use (default: 60%% of available RAM)")
    args = ap.parse_args(argv)
    if args.vocab % args.tp:
        ap.error(f"--vocab {args.vocab} is not divisible by --tp {args.tp}")

    budget = int(args.mem_budget_gib * GIB) if args.mem_budget_gib else int(
        0.6 * _available_bytes())
    naive_tokens = args.tokens
    while naive_tokens > 1 and naive_estimate(naive_tokens, args.vocab, args.dtype) > budget:
        naive_tokens = 1 << ((naive_tokens - 1).bit_length() - 1)   # next lower power of two
    print(f"shape: tokens={args.tokens} vocab={args.vocab} tp={args.tp} dtype={args.dtype} "
          f"chunk_size={args.chunk_size} temperature={args.temperature} "
          f"cores={os.cpu_count()} repeats={args.repeats}")
    print(f"naive estimate at tokens={args.tokens}: "
          f"{naive_estimate(args.tokens, args.vocab, args.dtype) / GIB:.1f} GiB; "
          f"budget {budget / GIB:.1f} GiB -> naive runs at tokens={naive_tokens}"
          + ("" if naive_tokens == args.tokens else "  (REDUCED: see per-token lines)"))
    print("naive = one process holding the full [tokens, vocab] logits (what every rank holds "
          "after the anchors' all-gather at TP>1; gather buffers not counted)")

    ours = _run("ours", args.tokens, args, args.tp)
    naive = _run("naive", naive_tokens, args, args.tp)
    rows = [ours, naive]
    ours_same = ours
    if naive_tokens != args.tokens:
        ours_same = _run("ours", naive_tokens, args, args.tp)
        rows.insert(1, ours_same)
    for r in rows:
        print(_fmt(r))
    print(f"peak source: {ours['source']}")

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else "n/a"

    print(f"same shape (tokens={naive_tokens}), per rank: naive/ours peak memory "
          f"{ratio(naive['peak'], ours_same['peak'])}, naive/ours extra saved-for-backward "
          f"{naive['saved_extra'] / GIB:.3f} GiB vs {ours_same['saved_extra'] / GIB:.6f} GiB, "
          f"naive/ours time {ratio(naive['time'], ours_same['time'])}")
    if naive_tokens != args.tokens:
        scale = args.tokens / naive_tokens
        print(f"per-token scaled to tokens={args.tokens} (naive x{scale:g}, ESTIMATED, naive "
              f"not run at this size): naive peak ~{naive['peak'] * scale / GIB:.2f} GiB/rank vs "
              f"ours {ours['peak'] / GIB:.2f} GiB/rank measured -> "
              f"{ratio(naive['peak'] * scale, ours['peak'])}; naive time ~"
              f"{naive['time'] * scale:.2f} s vs ours {ours['time']:.2f} s -> "
              f"{ratio(naive['time'] * scale, ours['time'])}")


if __name__ == "__main__":
    main()
