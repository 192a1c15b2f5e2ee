"""``python -m megatron_rl convert {hf-to-megatron, megatron-to-hf} ...`` and the two tools in
``tools/`` share these parsers and runners."""

from __future__ import annotations

import argparse
import json
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MiB"``, ``"123456"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r} is not understood (e.g. 2GB, 500MiB, "
                                         f"123456; units: {', '.join(k for k in _UNITS if k)})")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def add_hf_to_megatron_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output megatron checkpoint dir (new or empty)")
    p.add_argument("--tp", type=int, default=1, help="TP size the conversion runs at (the "
                   "checkpoint loads at any layout; more ranks = less memory per rank)")
    p.add_argument("--pp", type=int, default=1, help="PP size the conversion runs at")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="stored dtype (default: the HF checkpoint's)")
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="seconds the collectives of the conversion may wait (default 3600)")


def add_megatron_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="megatron dist_checkpointing checkpoint dir")
    p.add_argument("--out", required=True, help="output HF dir")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="written dtype (default: as stored)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GiB"),
                   help="largest safetensors shard (default 2GiB)")
    p.add_argument("--hf-config", default=None, help="config.json describing the model (default:"
                   " the one saved by hf-to-megatron)")
    p.add_argument("--preset", default=None, help="megatron_rl model preset instead of a config")


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron

    convert_hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                           timeout_s=args.timeout_s)
    return 0


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

    hf_config = None
    if args.hf_config:
        with open(args.hf_config) as f:
            hf_config = json.load(f)
    stats = convert_megatron_to_hf(args.ckpt, args.out, hf_config=hf_config, preset=args.preset,
                                   dtype=args.dtype, max_shard_bytes=args.max_shard_size)
    print(f"[megatron->hf] rank {stats['rank']}: {len(stats['shards'])} shard(s), "
          f"{stats['bytes'] / 2**30:.3f} GiB in {stats['wall_s']:.1f}s, peak RSS "
          f"{stats['peak_rss'] / 2**30:.2f} GiB")
    return 0


def add_convert_subcommand(subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` (with ``hf-to-megatron`` and ``megatron-to-hf``) on ``subparsers``.

    Each leaf sets ``func`` to a runner taking the parsed args and returning an exit code.
    """
    c = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and "
                              "megatron (dist_checkpointing) formats")
    sub = c.add_subparsers(dest="direction", required=True, metavar="DIRECTION",
                           help="hf-to-megatron or megatron-to-hf")
    h2m = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron checkpoint; runs TPxPP"
                         " local ranks, or in place under torchrun/SLURM")
    add_hf_to_megatron_args(h2m)
    h2m.set_defaults(func=run_hf_to_megatron)
    m2h = sub.add_parser("megatron-to-hf", help="megatron checkpoint -> HF safetensors + "
                         "config.json; under torchrun each rank writes its share of the shards")
    add_megatron_to_hf_args(m2h)
    m2h.set_defaults(func=run_megatron_to_hf)
    return c
