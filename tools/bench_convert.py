"""Benchmark: HF -> Megatron -> HF conversion of a random ~1B-parameter model.

    python tools/bench_convert.py                      # Qwen2-style, 1.03B params, bf16
    python tools/bench_convert.py --nproc-tp 2 --shard-size 500MB

A random model is made with ``transformers`` from a config (nothing downloaded) and saved as
safetensors shards in a temporary directory. Each direction runs in fresh processes
(``megatron_rl.parallel.launch.spawn``), which report their own peak RSS (``ru_maxrss``); the
numbers are printed as wall time and as a multiple of the largest input shard file. The baseline
RSS of a process after its imports is printed too, so the conversion's own share can be read off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

import torch  # noqa: E402


def make_model(out: str, args: argparse.Namespace) -> int:
    """Save a random Qwen2 model; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=args.shard_size)
    del model
    gc.collect()
    return n


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def m2h_worker(ckpt: str, out: str, max_shard_bytes: int) -> dict:
    """One fresh process converting megatron -> HF."""
    import megatron_rl.convert.megatron_to_hf as m2h

    base = _rss_now()
    stats = m2h.convert_megatron_to_hf(ckpt, out, max_shard_bytes=max_shard_bytes,
                                       rank=0, world_size=1, log=lambda _m: None)
    return dict(stats, baseline_rss=base)


def baseline_worker() -> int:
    """RSS of a rank after the imports the HF -> megatron conversion needs."""
    import megatron.core  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401

    import megatron_rl.convert.hf_to_megatron  # noqa: F401
    return _rss_now()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--shard-size", default="500MB", help="HF shard size of the generated model")
    p.add_argument("--nproc-tp", type=int, default=1, help="TP ranks for HF -> megatron")
    p.add_argument("--workdir", default=None, help="default: a temporary directory (removed)")
    args = p.parse_args(argv)

    from megatron_rl.convert.hf_io import HFCheckpoint
    from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_rl.parallel.launch import spawn

    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    hf_dir, mg_dir, back_dir = (os.path.join(work, d) for d in ("hf", "megatron", "hf_back"))
    try:
        t0 = time.perf_counter()
        n = make_model(hf_dir, args)
        shard = HFCheckpoint(hf_dir).largest_file_bytes()
        total = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                    if f.endswith(".safetensors"))
        print(f"model: {n / 1e9:.3f}B params, bf16, {total / 2**30:.2f} GiB in shards of <= "
              f"{shard / 2**20:.0f} MiB (made in {time.perf_counter() - t0:.0f}s)")
        base = spawn(baseline_worker, 1, timeout_s=300)[0]

        t0 = time.perf_counter()
        h2m = convert_hf_to_megatron(hf_dir, mg_dir, tp=args.nproc_tp, pp=1,
                                     log=lambda _m: None)
        h2m_wall = time.perf_counter() - t0
        h2m_rss = max(s["peak_rss"] for s in h2m)

        t0 = time.perf_counter()
        m2h = spawn(m2h_worker, 1, (mg_dir, back_dir, shard), timeout_s=3600)[0]
        m2h_wall = time.perf_counter() - t0

        rows = [
            (f"HF -> Megatron (TP{args.nproc_tp} ranks)", h2m_wall, h2m_rss, base),
            ("Megatron -> HF (1 process)", m2h_wall, m2h["peak_rss"], m2h["baseline_rss"]),
        ]
        print(f"{'direction':<28} {'wall s':>7} {'peak RSS GiB':>13} {'x shard':>8} "
              f"{'(peak-base) x shard':>20}")
        for name, wall, rss, b in rows:
            print(f"{name:<28} {wall:>7.1f} {rss / 2**30:>13.2f} {rss / shard:>8.2f} "
                  f"{(rss - b) / shard:>20.2f}")
        print(f"largest input shard {shard / 2**20:.0f} MiB; import baseline RSS "
              f"{base / 2**30:.2f} GiB (HF->Megatron rank), {m2h['baseline_rss'] / 2**30:.2f} GiB "
              f"(Megatron->HF); largest output shard {m2h['max_shard_bytes'] / 2**20:.0f} MiB")
        print(json.dumps({"params": n, "largest_shard_bytes": shard, "h2m_wall_s": h2m_wall,
                          "h2m_peak_rss": h2m_rss, "m2h_wall_s": m2h_wall,
                          "m2h_peak_rss": m2h["peak_rss"]}))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
