"""The data of a sweep (:mod:`megatron_rl.cli.sweep`): its plan, its runs, and reading a run's
metrics back; shared by the sweep runner and the study report (:mod:`megatron_rl.cli.study`)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

DONE = "sweep_done.json"


@dataclass
class Condition:
    """One run: ``sweep``/``name`` and its dotted-key overrides."""

    sweep: str
    name: str
    overrides: dict[str, Any]
    run_dir: str = ""
    total_steps: int = 0  # trainer.total_steps of the run (progress)
    label: str = ""  # the condition's own name (without grid point and seed)
    group: str = ""  # the condition without its seed (runs of one group differ only by seed)
    point: dict[str, Any] = field(default_factory=dict)  # its grid point ({} without a grid)
    seed: int | None = None  # None: the sweep file has no ``seeds``


@dataclass
class SweepPlan:
    base: str
    output_dir: str
    parallel_runs: int
    sweeps: dict[str, str] = field(default_factory=dict)  # sweep name -> axis label
    conditions: list[Condition] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # [] : one run per condition
    grids: dict[str, dict[str, list]] = field(default_factory=dict)  # sweep -> its grid
    collapse_metric: str = "policy/entropy"
    collapse_fraction: float = 0.5

    @property
    def is_study(self) -> bool:
        """Seeds or a grid: the report adds the summary over seeds (:mod:`.study`)."""
        return bool(self.seeds) or any(self.grids.values())


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", str(text)).strip("_") or "run"


def is_done(c: Condition) -> bool:
    return os.path.exists(os.path.join(c.run_dir, DONE))


def read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
