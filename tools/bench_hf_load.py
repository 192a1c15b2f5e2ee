"""Peak memory of loading a Hugging Face directory as the actor (``model.hf_path``), per rank.

    python tools/bench_hf_load.py                    # ~0.3B-param Qwen2, bf16 shards, TP2 x PP2
    python tools/bench_hf_load.py --tp 2 --pp 1 --layers 8

A random model is saved with ``transformers`` (nothing downloaded). Each of the TP x PP ranks then
builds its stage without random init (fp32 parameters, as the actor does), touches it, fills it
with :class:`megatron_rl.convert.model_source.HFShardSource` (each rank reads only its own
slices), and reports: its RSS before the load (imports + its resident stage), its peak RSS
(``VmHWM``, reset with ``/proc/self/clear_refs`` just before the load) during the load, the bytes
of its own shard,
the bytes it read from the files, and the whole model's size. ``peak - before`` is the load's own
cost; it should be about one shard's slices at most, never the model.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

import torch  # noqa: E402


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def load_worker(hf_dir: str, tp: int, pp: int) -> dict:
    from megatron_rl.convert.hf_to_megatron import build_uninitialized_model
    from megatron_rl.convert.model_source import HFShardSource
    from megatron_rl.convert.registry import read_hf_config
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp)
    cfg = read_hf_config(hf_dir)[1]
    model = build_uninitialized_model(cfg, torch.float32)
    with torch.no_grad():  # make the stage resident, so that "before" counts it
        for param in model.parameters():
            param.zero_()
    gc.collect()
    hwm_before = _rss("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    before = _rss("VmRSS")
    src = HFShardSource(hf_dir, cfg)
    src.load_into(model)
    stage = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"rank": torch.distributed.get_rank(), "rss_before": before, "hwm_before": hwm_before,
           "peak": _rss("VmHWM"), "bytes_read": src.bytes_read, "own_bytes": src.own_bytes,
           "stage_fp32": stage, "total": sum(i.nbytes for i in src.ckpt.info.values()),
           "largest_tensor": max(i.nbytes for i in src.ckpt.info.values())}
    runtime.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--shard-size", default="200MB")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_rl.parallel.launch import spawn

    work = tempfile.mkdtemp(prefix="bench_hf_load_")
    try:
        cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.ffn, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                          tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        n = sum(x.numel() for x in model.parameters())
        model.save_pretrained(work, max_shard_size=args.shard_size)
        del model
        gc.collect()
        res = spawn(load_worker, args.tp * args.pp, (work, args.tp, args.pp), timeout_s=1800)
        gib = 2**20
        total = res[0]["total"]
        print(f"model: {n / 1e9:.3f}B params, {total / gib:.0f} MiB bf16 on disk; largest tensor "
              f"{res[0]['largest_tensor'] / gib:.0f} MiB; TP{args.tp} x PP{args.pp}")
        print(f"{'rank':>4} {'read MiB':>9} {'own shard MiB':>14} {'stage fp32 MiB':>15} "
              f"{'RSS before MiB':>15} {'peak MiB':>9} {'peak-before MiB':>16}")
        for r in sorted(res, key=lambda r: r["rank"]):
            print(f"{r['rank']:>4} {r['bytes_read'] / gib:>9.1f} {r['own_bytes'] / gib:>14.1f} "
                  f"{r['stage_fp32'] / gib:>15.1f} {r['rss_before'] / gib:>15.0f} "
                  f"{r['peak'] / gib:>9.0f} {(r['peak'] - r['rss_before']) / gib:>16.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
