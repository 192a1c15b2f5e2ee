"""The ``serve`` subcommand's arguments, without importing torch (the CLI builds every
subcommand's parser on each start; the server itself is :mod:`megatron_rl.rollout.serve`)."""

from __future__ import annotations

import argparse

from megatron_rl.rollout.serve_rules import NEW_RULES, RULES


def add_serve_subcommand(sub) -> None:
    """``serve`` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="OUR rollout server with SGLang's HTTP API subset "
                       "(CPU/tests; not SGLang)")
    p.add_argument("--preset", default=None, help="model preset (random weights; default tiny)")
    p.add_argument("--model-path", default=None, help="HF dir (config.json [+ safetensors])")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--eos-id", type=int, default=None, help="stop token added to every request")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--sglang-rules", default=NEW_RULES, choices=RULES,
                   help="imitate SGLang >= 0.5.21 (weight-update sessions, /weights_checker, "
                   "/flush_cache?timeout) or <= 0.5.20")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="as SGLang: honour requests' return_routed_experts (MoE routing replay)")
    p.add_argument("--enable-lora", action="store_true",
                   help="as SGLang: /load_lora_adapter, /unload_lora_adapter and generate "
                   "requests' lora_path (needs --max-lora-rank and --lora-target-modules)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="as SGLang: the largest adapter rank a load accepts")
    p.add_argument("--lora-target-modules", nargs="*", default=None,
                   help="as SGLang: the HF module names adapters may target (q_proj, ...)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from megatron_rl.rollout.serve import cmd_serve

    return cmd_serve(args)
