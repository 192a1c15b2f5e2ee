"""``python -m megatron_rl.cli.restart [--max-restarts N] [--backoff-s S] -- COMMAND ...``: run
COMMAND (the ``srun`` step of ``megatron_rl train`` in a batch script) again when it fails, up to
``trainer.max_restarts`` times with backoff, read from the train command's config unless given
(:func:`megatron_rl.parallel.restart.supervise`; docs/reliability.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from megatron_rl.parallel.restart import RestartPolicy, supervise


def _train_args(cmd: Sequence[str]) -> tuple[str | None, list[str]] | None:
    """``(config, overrides)`` of the ``megatron_rl train`` command inside ``cmd``, or None."""
    cmd = list(cmd)
    for i in range(len(cmd) - 2):
        if cmd[i] == "-m" and cmd[i + 1] == "megatron_rl" and cmd[i + 2] == "train":
            rest = [a for a in cmd[i + 3:] if not a.startswith("-")]
            if not rest or ("=" in rest[0] and not os.path.exists(rest[0])):
                return None, rest  # no YAML: the built-in recipe (as ``train`` reads it)
            return rest[0], rest[1:]
    return None


def policy_for(cmd: Sequence[str], max_restarts: int | None,
               backoff_s: float | None) -> RestartPolicy:
    """The policy of the ``train`` command in ``cmd`` (its config's ``trainer.max_restarts`` and
    ``trainer.restart_backoff_s``), with the given values taking precedence."""
    base = RestartPolicy()
    found = _train_args(cmd)
    if found is not None and (max_restarts is None or backoff_s is None):
        from megatron_rl.config.default_recipe import DEFAULT_RECIPE
        from megatron_rl.config.load import load_config

        config, overrides = found
        cfg = load_config(config, overrides, base=None if config else DEFAULT_RECIPE)
        base = RestartPolicy.of(cfg.trainer)
    return RestartPolicy(base.max_restarts if max_restarts is None else max_restarts,
                         base.backoff_s if backoff_s is None else backoff_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_rl.cli.restart",
        description="Run a command (an srun step of `megatron_rl train`) again when it fails, up "
                    "to trainer.max_restarts times with backoff (read from the train command's "
                    "config unless given).")
    ap.add_argument("--max-restarts", type=int, default=None)
    ap.add_argument("--backoff-s", type=float, default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command to run after --")
    if (args.max_restarts is not None and args.max_restarts < 0) or \
            (args.backoff_s is not None and args.backoff_s < 0):
        ap.error("--max-restarts and --backoff-s must be >= 0")
    from megatron_rl.config.errors import ConfigError

    try:
        policy = policy_for(cmd, args.max_restarts, args.backoff_s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return supervise(cmd, policy, log=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main())
