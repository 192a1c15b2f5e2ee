"""Benchmark: fused linear head + log-prob + entropy vs the naive path, the chunked torch
reference and the bare matmul (the compute floor).

    python tools/bench_fused_head.py                 # GPU: N=16384, H=5120, V=151936, TP 1 and 4
    python tools/bench_fused_head.py --small         # reduced shape (automatic without a GPU)

Variants, each in a fresh process (:func:`megatron_rl.parallel.launch.spawn`, one rank), for each
``V_local = V / TP`` (one rank's shard; the per-token collectives of the vocab-parallel paths
carry ``[N]``-sized vectors and are not part of this single-process measurement):

* (a) ``naive``: ``logits = hidden @ W.T`` in the input dtype, then ``log_softmax``, ``softmax``
  and ``-(p * log p).sum()`` in fp32 (what the anchors do), autograd backward;
* (b) ``chunked``: :func:`megatron_rl.kernels.fused_head.fused_linear_logprob_entropy` with the
  torch elementwise pass (row chunks, GEMMs in the input dtype);
* (c) ``fused``: the same function with the Triton elementwise pass (needs a CUDA GPU);
* (d) ``matmul``: the bare ``hidden @ W.T`` (forward), and ``matmul3``: that plus the two
  gradient matmuls ``dlogits @ W`` and ``dlogits.T @ hidden`` that any backward needs.

(b) and (c) run as inside the actor: the weight carries megatron DDP's fp32 ``main_grad``
(allocated with the inputs, before the baseline) and ``grad_weight`` is added into it
(``use_main_grad=True``; ``--no-main-grad``: autograd ``.grad`` instead). Per variant: forward
time, forward+backward time (best of ``--repeats`` after one warm-up), the peak memory increase
during one cold forward+backward over the post-setup baseline (``torch.cuda.max_memory_allocated``
on GPU, the process's peak RSS ``VmHWM``, reset after setup, on CPU), and that peak minus the
gradient outputs the variant must produce (``[N, H]`` + ``[V_local, H]`` in the input dtype for
autograd grads, ``[N, H]`` only when ``grad_weight`` goes into the pre-existing ``main_grad``).
Ratios printed against the goals of issue 14: forward / bare matmul (<= 1.25x), forward+backward
/ three matmuls (<= 1.5x), peak beyond the grad outputs / (a)'s ``[N, V_local]`` logits buffer
(<= 10%). Without a GPU, (c) is reported as not run and the ratios are printed for (b). CPU
numbers on a small box are indicative only (CPU GEMMs, no tensor cores).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.parallel.launch import WorkerError, spawn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import rss_kib  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIB = 1024 ** 2
FULL = dict(tokens=16384, hidden=5120, vocab=151936)
SMALL = dict(tokens=512, hidden=1024, vocab=32768)


# --------------------------------------------------------------------------------------------
# Memory probes
# --------------------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    return rss_kib(field)


class PeakProbe:
    """Peak memory increase over a baseline: CUDA allocator on GPU, VmHWM on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
            f.write("5")
        self.base = _rss_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _rss_kib("VmHWM") * 1024 - self.base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# Worker (one process per variant and shape)
# --------------------------------------------------------------------------------------------
def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (3.0 / h ** 0.5 * torch.randn(v, h, generator=g)).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    g_lp = torch.randn(n, generator=g).to(device)
    g_h = torch.randn(n, generator=g).to(device)
    return hidden.requires_grad_(True), weight.requires_grad_(True), labels, g_lp, g_h


def _make_step(variant: str, hidden, weight, labels, g_lp, g_h, chunk_size, main_grad: bool):
    """``step(backward: bool)`` for one variant."""
    from megatron_rl.kernels.fused_head import fused_linear_logprob_entropy
    from megatron_rl.ops import naive_logprob_entropy

    dlogits = None
    if variant == "matmul3":
        dlogits = torch.randn(hidden.size(0), weight.size(0), device=hidden.device,
                              dtype=hidden.dtype)

    def step(backward: bool) -> None:
        if variant in ("matmul", "matmul3"):
            with torch.no_grad():
                logits = hidden @ weight.t()
                if backward and dlogits is not None:
                    dlogits @ weight                # grad wrt hidden
                    dlogits.t() @ hidden            # grad wrt weight
            del logits
            return
        if variant == "naive":
            logp, ent = naive_logprob_entropy(hidden @ weight.t(), labels)
        else:
            logp, ent = fused_linear_logprob_entropy(
                hidden, weight, labels, chunk_size=chunk_size, use_main_grad=main_grad,
                backend="triton" if variant == "fused" else "torch")
        if backward:
            ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
            hidden.grad = weight.grad = None

    return step


def _time(step, backward: bool, repeats: int, device: torch.device) -> float:
    step(backward)                                   # warm-up (Triton compile, allocator)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step(backward)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_worker(variant: str, n: int, h: int, v: int, dtype: str, repeats: int,
                 chunk_size: int | None, main_grad: bool) -> dict:
    """Time and peak memory of one variant at ``[N, H] x [V_local, H]``."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    hidden, weight, labels, g_lp, g_h = _inputs(n, h, v, DTYPES[dtype], device)
    use_mg = main_grad and variant in ("chunked", "fused")
    if use_mg:          # megatron DDP's fp32 grad buffer view, allocated before the baseline
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    step = _make_step(variant, hidden, weight, labels, g_lp, g_h, chunk_size, use_mg)
    probe = PeakProbe(device)
    item = hidden.element_size()
    out = dict(variant=variant, grad_out=(n * h + (0 if use_mg else v * h)) * item)
    backward = variant != "matmul"
    probe.start()
    step(backward)                                   # peak of one fwd(+bwd) from a cold start
    out["peak"] = probe.peak()
    if variant not in ("matmul", "matmul3"):
        out["fwd"] = _time(step, False, repeats, device)
    out["fwd_bwd" if backward else "fwd"] = _time(step, backward, repeats, device)
    return out


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def _run(variant: str, n: int, h: int, v: int, args) -> dict:
    env = {"MRL_THREADS_PER_RANK": str(os.cpu_count() or 1)}
    try:
        return spawn(bench_worker, 1, (variant, n, h, v, args.dtype, args.repeats,
                                       args.chunk_size, not args.no_main_grad),
                     timeout_s=args.timeout, env=env)[0]
    except (WorkerError, TimeoutError) as exc:
        reason = "OOM" if "out of memory" in str(exc).lower() else type(exc).__name__
        return dict(variant=variant, error=reason, detail=str(exc).splitlines()[-1][:200])


def _fmt_row(r: dict, logits_bytes: int) -> str:
    if "error" in r:
        return f"  {r['variant']:<9} failed: {r['error']} ({r['detail']})"
    fwd = f"{r['fwd'] * 1e3:9.1f} ms" if "fwd" in r else " " * 12
    fb = f"{r['fwd_bwd'] * 1e3:9.1f} ms" if "fwd_bwd" in r else " " * 12
    beyond = (f"  beyond the grad outputs {r['beyond'] / MIB:8.1f} MiB "
              f"({r['beyond'] / logits_bytes:6.1%} of (a)'s logits)") if "beyond" in r else ""
    return (f"  {r['variant']:<9} fwd {fwd}  fwd+bwd {fb}  "
            f"peak extra {r['peak'] / MIB:8.1f} MiB{beyond}")


def _ratios(label: str, r: dict, mm: dict, mm3: dict, logits_bytes: int) -> list[str]:
    if "error" in r or "error" in mm or "error" in mm3:
        return [f"  ratios for {label}: not available (a variant failed)"]
    return [f"  {label} fwd / bare matmul (d)            = {r['fwd'] / mm['fwd']:6.2f}x  "
            f"(goal <= 1.25x)",
            f"  {label} fwd+bwd / three bare matmuls     = {r['fwd_bwd'] / mm3['fwd_bwd']:6.2f}x  "
            f"(goal <= 1.5x)",
            f"  {label} peak beyond grad outputs / (a) logits buf = "
            f"{r['beyond'] / logits_bytes:6.2%}  (goal <= 10%)"]


def main(argv=None) -> None:
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true",
                    help=f"reduced shape {SMALL} (automatic without a GPU)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--tp", type=str, default="1,4", help="comma-separated TP sizes (V/TP)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default bf16 on GPU, fp32 on CPU (CPU bf16 GEMMs are ~10x slower than "
                         "fp32 without AMX, which would swamp every ratio)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="(b), (c): rows per chunk (default: sized to ~8%% of the logits)")
    ap.add_argument("--no-main-grad", action="store_true",
                    help="(b), (c): grad_weight as autograd .grad instead of into main_grad")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)

    gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    small = args.small or not gpu
    shape = dict(SMALL if small else FULL)
    for key in ("tokens", "hidden", "vocab"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    device = torch.cuda.get_device_name(0) if gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device}; dtype {args.dtype}; N={n} H={h} V={v}"
          f"{' (reduced shape)' if small else ''}; best of {args.repeats} after a warm-up")
    if not gpu:
        print("(c) fused Triton kernel: NOT RUN -- it needs a CUDA GPU (Triton's CPU interpreter "
              "is for correctness tests only); ratios below are for (b) instead.")
    item = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    variants = ["naive", "chunked"] + (["fused"] if gpu else []) + ["matmul", "matmul3"]
    for tp in (int(x) for x in args.tp.split(",")):
        v_local = v // tp
        logits_bytes = n * v_local * item
        print(f"\nTP={tp}: V_local={v_local}; (a)'s [N, V_local] logits buffer "
              f"{logits_bytes / MIB:.1f} MiB")
        res = {name: _run(name, n, h, v_local, args) for name in variants}
        for name, r in res.items():
            if "peak" in r and name != "matmul":
                r["beyond"] = r["peak"] - r["grad_out"]
        for name in variants:
            print(_fmt_row(res[name], logits_bytes))
        target = "fused" if gpu else "chunked"
        for line in _ratios(f"({'c' if gpu else 'b'}) {target}", res[target], res["matmul"],
                            res["matmul3"], logits_bytes):
            print(line)
        if gpu:
            for line in _ratios("(b) chunked", res["chunked"], res["matmul"], res["matmul3"],
                                logits_bytes):
                print(line)


if __name__ == "__main__":
    main()
