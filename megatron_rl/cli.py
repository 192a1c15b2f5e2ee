"""Command-line entry points: ``python -m megatron_rl <command> ...``."""

from __future__ import annotations

import argparse
import sys


def _cmd_check(args: argparse.Namespace) -> int:
    from megatron_rl.check import format_report, parity

    rep = parity(args.tp, args.pp, preset=args.model, micro_batches=args.micro_batches,
                 batch=args.batch, seq=args.seq, seed=args.seed, temperature=args.temperature,
                 chunk_size=args.chunk_size)
    print(format_report(rep, args.atol))
    return 0 if rep.ok(args.atol) else 1


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m megatron_rl",
                                description="RL post-training on megatron-core")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="per-token log-prob/entropy parity of a TPxPP layout vs "
                                     "TP1xPP1 on the same weights (gloo processes on CPU)")
    c.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    c.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    c.add_argument("--model", default="tiny", help="model preset (default tiny)")
    c.add_argument("--micro-batches", type=int, default=2)
    c.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    c.add_argument("--seq", type=int, default=32, help="sequence length")
    c.add_argument("--seed", type=int, default=1234)
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--chunk-size", type=int, default=None,
                   help="token chunk of the log-prob/entropy op (default: unchunked)")
    c.add_argument("--atol", type=float, default=1e-5)
    c.set_defaults(func=_cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
