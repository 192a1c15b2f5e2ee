"""Several single-rank training runs one after another in one process (used by the tests).

Each ``megatron_rl train`` command pays a launcher start, a rank start (imports of torch and
megatron-core) and the end-of-run plots; a test that only needs to know that each of many recipes
runs end to end can run them all through :func:`train_each` inside one spawned rank instead. Every
run gets a fresh rendezvous port and tears torch.distributed and megatron's parallel state down
at its end (:func:`megatron_rl.run.trainer.train` does), so the runs are independent.
"""

from __future__ import annotations

import os
import traceback
from typing import Any


def train_each(jobs: list[tuple[str, str | None, list[str]]]) -> dict[str, dict[str, Any]]:
    """Run ``(name, config path or None for the built-in recipe, overrides)`` jobs in turn on
    this process (one rank, TP1 x PP1 x DP1). Returns ``{name: {"summary": ...}}`` or
    ``{name: {"error": traceback}}``; a failing run does not stop the ones after it."""
    from megatron_rl.config.default_recipe import DEFAULT_RECIPE
    from megatron_rl.config.load import load_config
    from megatron_rl.parallel import runtime
    from megatron_rl.parallel.launch import free_port
    from megatron_rl.run import trainer

    results: dict[str, dict[str, Any]] = {}
    for name, config, overrides in jobs:
        os.environ["MASTER_PORT"] = str(free_port())
        try:
            cfg = load_config(config, list(overrides), base=None if config else DEFAULT_RECIPE)
            results[name] = {"summary": trainer.train(cfg)}
        except Exception:  # noqa: BLE001 - reported per job to the test
            results[name] = {"error": traceback.format_exc()}
            runtime.shutdown()
    return results
