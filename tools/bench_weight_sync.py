"""Weight-sync throughput per strategy vs the link's measured bandwidth.

Starts one of our ``serve`` processes holding a random model of the chosen shape (Qwen2.5-0.5B
or Qwen2.5-7B dimensions, fp32 on CPU), pushes every weight with each strategy that can run here
(``from_disk``, ``from_tensor`` via /dev/shm on CPU, ``from_distributed`` over gloo on CPU; NCCL /
CUDA IPC need a GPU and SGLang) and prints GB/s achieved next to the link's measured bandwidth:
memcpy (what a colocated copy can reach) and loopback TCP (what gloo/HTTP can reach). Each
strategy runs ``--syncs`` syncs: the first also allocates (shared-memory files, process groups),
the later ones are what every step of a run costs.

With ``--quantization fp8`` the buckets are bf16 (a bf16 actor's) and every strategy runs twice
per sync, bf16 as sent and FP8 (``rollout.sglang.quantization: fp8``: the layers SGLang
quantises as block FP8 + scales, :mod:`megatron_rl.rollout.fp8`), printing bytes per sync (all,
and of the quantised layers alone), sync seconds and the seconds spent quantising.

    python tools/bench_weight_sync.py                 # 0.5B; 7B when the RAM allows
    python tools/bench_weight_sync.py --models 0.5b --bucket-mb 256
    python tools/bench_weight_sync.py --models 0.5b --quantization fp8
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {  # HF Qwen2 configs (random weights)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}


def memcpy_gbps(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Best of ``reps`` copies of a ``nbytes`` buffer (GB/s)."""
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def memcpy_same_bytes_s(buckets, dst) -> float:
    """Seconds to copy every tensor of ``buckets`` into ``dst`` (allocated once, touched): the
    bytes a sync moves, one copy, measured next to the sync (a busy machine slows both)."""
    t0 = time.perf_counter()
    for b, d in zip(buckets, dst):
        for (_, t), o in zip(b, d):
            o.copy_(t)
    return time.perf_counter() - t0


def loopback_gbps(nbytes: int = 256 * 2**20) -> float:
    """One TCP transfer of ``nbytes`` over 127.0.0.1 (GB/s)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    payload = bytes(nbytes)

    def send() -> None:
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(payload)
        c.close()

    th = threading.Thread(target=send)
    conn_t0 = time.perf_counter()
    th.start()
    conn, _ = srv.accept()
    got, buf = 0, bytearray(8 * 2**20)
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    dt = time.perf_counter() - conn_t0
    th.join()
    conn.close()
    srv.close()
    return got / dt / 1e9


def model_bytes(shape: dict) -> int:
    """fp32 bytes of the model's parameters (counted from the config, nothing allocated)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    layer = h * h + 2 * h * kv + h * h + h + 2 * kv + 3 * h * i + 2 * h
    emb = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return 4 * (n * layer + emb + h)


def write_config(shape: dict, out: str) -> str:
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", max_position_embeddings=4096, **shape).save_pretrained(out)
    return out


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    from megatron_rl.rollout.fleet import wait_healthy

    wait_healthy(url, timeout, proc)


def buckets_of(names_shapes: list[tuple[str, list[int]]], bucket_bytes: int,
               dtype: torch.dtype = torch.float32):
    """Random buckets of ``dtype`` (generated once, reused by every strategy)."""
    from megatron_rl.convert.stream import bucketize

    g = torch.Generator().manual_seed(0)
    pairs = [(n, (torch.randn(s, generator=g) * 0.02).to(dtype)) for n, s in names_shapes]
    return list(bucketize(pairs, bucket_bytes))


def bench_model(name: str, args) -> list[tuple[str, float, float]]:
    """(strategy, seconds, GB/s) per strategy for one model shape."""
    from megatron_rl.rollout.fleet import http_json
    from megatron_rl.rollout.weight_sync import strategy_class

    shape = SHAPES[name]
    tmp = tempfile.mkdtemp(prefix=f"bench_wsync_{name}_")
    cfg_dir = write_config(shape, os.path.join(tmp, "model"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl", "serve", "--model-path",
                             cfg_dir, "--port", str(port), "--threads", "2"], env=env)
    rows = []
    try:
        wait_up(url, proc)
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg_dir))
        names_shapes = [(n, list(p.shape)) for n, p in meta.named_parameters()]
        dtype = torch.bfloat16 if args.quantization == "fp8" else torch.float32
        buckets = buckets_of(names_shapes, args.bucket_mb * 2**20, dtype)
        total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        if args.quantization == "fp8":
            rows += bench_fp8(name, url, cfg_dir, tmp, buckets, args)
            return rows
        dst = [[torch.empty_like(t) for _, t in b] for b in buckets]
        memcpy_same_bytes_s(buckets, dst)  # touch dst once
        for strat in args.strategies:
            base, _, transport = strat.partition("/")  # from_tensor/shm: shared-memory files
            st = strategy_class(base)([url], os.path.join(tmp, "sync"), 0, model_path=cfg_dir)
            if transport:
                st.transport = transport
            for sync in range(1, args.syncs + 1):  # sync 1 allocates buffers / groups
                mc = memcpy_same_bytes_s(buckets, dst)  # side by side: just before the sync
                st.begin(sync - 1)
                t0 = time.perf_counter()
                st.send(buckets, version=sync)
                st.commit(sync)
                dt = time.perf_counter() - t0
                st.resume()
                if st.spot_check():
                    raise RuntimeError(f"{strat}: spot check failed")
                got = http_json("GET", url + "/get_model_info")["weight_version"]
                assert got == str(sync), got
                rows.append((strat, dt, total / dt / 1e9))
                link, ceiling = ("loopback TCP", args.loopback) \
                    if strat == "from_distributed" else ("memcpy", args.memcpy)
                print(f"  {name} {strat:17s} sync {sync} {total / 1e9:6.2f} GB in {dt:7.2f} s"
                      f" = {total / dt / 1e9:6.3f} GB/s = {total / dt / 1e9 / ceiling:6.1%} of "
                      f"{link} ({ceiling:.2f} GB/s); {mc / dt:6.1%} of a memcpy of the same "
                      f"bytes ({mc:.2f} s, just before; load {os.getloadavg()[0]:.1f})",
                      flush=True)
            if hasattr(st, "close"):
                st.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)  # the from_disk copy is as big as the model
    return rows


def quantized_bytes(buckets) -> tuple[int, int]:
    """``(bf16 bytes, FP8 + scale bytes)`` of the layers SGLang quantises in ``buckets``."""
    from megatron_rl.rollout.fp8 import is_quantized

    bf16 = fp8 = 0
    for b in buckets:
        for n, t in b:
            if is_quantized(n):
                rows, cols = t.shape
                bf16 += t.numel() * 2
                fp8 += t.numel() + 4 * (-(-rows // 128)) * (-(-cols // 128))
    return bf16, fp8


def bench_fp8(name: str, url: str, cfg_dir: str, tmp: str, buckets, args) -> list:
    """bf16 vs FP8 syncs per strategy, side by side: (label, seconds, bytes) rows."""
    from megatron_rl.rollout.weight_sync import strategy_class

    q_bf16, q_fp8 = quantized_bytes(buckets)
    print(f"  {name}: quantised layers {q_bf16 / 1e9:.3f} GB bf16 -> {q_fp8 / 1e9:.3f} GB FP8 + "
          f"scales ({q_fp8 / q_bf16:.3f}x)", flush=True)
    rows = []
    for strat in args.strategies:
        base, _, transport = strat.partition("/")
        for quant in (None, "fp8"):
            st = strategy_class(base)([url], os.path.join(tmp, "sync"), 0, model_path=cfg_dir)
            st.quantization = quant
            if transport:
                st.transport = transport
            for sync in range(1, args.syncs + 1):
                st.begin(sync - 1)
                t0 = time.perf_counter()
                sent = st.send(buckets, version=sync)
                st.commit(sync)
                dt = time.perf_counter() - t0
                st.resume()
                label = f"{strat}/{quant or 'bf16'}"
                rows.append((label, dt, sent))
                print(f"  {name} {label:22s} sync {sync} {sent / 1e9:6.3f} GB in {dt:6.2f} s"
                      f" (quantising {st.quant_s:5.2f} s; load {os.getloadavg()[0]:.1f})",
                      flush=True)
            if hasattr(st, "close"):
                st.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0.5b,7b", help="comma list of 0.5b,7b")
    p.add_argument("--strategies", default="from_disk,from_tensor,from_distributed",
                   help="comma list; from_tensor/shm: from_tensor through shared-memory files")
    p.add_argument("--bucket-mb", type=int, default=128)
    p.add_argument("--syncs", type=int, default=2, help="syncs per strategy (the first also "
                   "allocates buffers and groups; later ones are the steady state of a run)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: bf16 buckets, each strategy as bf16 and as FP8 side by side")
    p.add_argument("--skip-7b", action="store_true", help="skip the 7B shape (needs ~70 GB RAM "
                   "on CPU: the server's fp32 model + the sender's buckets + a from_disk copy)")
    args = p.parse_args(argv)
    args.strategies = args.strategies.split(",")
    import psutil

    mem = memcpy_gbps()
    lo = loopback_gbps()
    args.memcpy, args.loopback = mem, lo
    print(f"link: memcpy {mem:.2f} GB/s, loopback TCP {lo:.2f} GB/s "
          f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch "
          f"{torch.__version__})", flush=True)
    for name in args.models.split(","):
        need = 2.3 * model_bytes(SHAPES[name])
        avail = psutil.virtual_memory().available
        if (name == "7b" and args.skip_7b) or need > avail:
            print(f"  {name}: skipped ({model_bytes(SHAPES[name]) / 1e9:.1f} GB fp32 model; "
                  f"needs ~{need / 1e9:.0f} GB RAM, {avail / 1e9:.0f} GB available)")
            continue
        bench_model(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
