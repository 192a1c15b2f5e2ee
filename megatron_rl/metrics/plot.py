"""``plot_run(run_dir)``: PNG curves from ``run_dir/metrics.jsonl`` (matplotlib, Agg backend).

Written to ``run_dir/plots/`` (or ``out_dir``):

* topic figures, one axes each with every matching key (a figure is skipped when no key
  matches): ``reward.png`` (keys with "reward" or "score"), ``accuracy.png`` ("acc": train and
  val), ``entropy.png``, ``clip_fraction.png`` ("clipfrac", "clip_frac", "clip_ratio",
  "clipped"), ``erc.png`` ("erc"), ``covariance.png`` ("cov"), ``early_stopping.png``
  ("early_stopped/"), ``timing.png`` ("time/" or "timing/");
* ``prefix_<p>.png``: a grid with one small axes per numeric key, for each key prefix
  (text before the first "/"; keys without "/" go to ``prefix_misc.png``).

Missing values (null, absent on some steps, e.g. validation every ``test_freq`` steps) are
skipped; sparse series get markers. ``FileNotFoundError`` if there is no metrics file and
``ValueError`` if it has no numeric metrics.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict

SKIP_KEYS = {"step", "time", "wall_s"}

TOPICS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward", "score")),
    ("accuracy", ("acc",)),
    ("entropy", ("entropy",)),
    ("clip_fraction", ("clipfrac", "clip_frac", "clip_ratio", "clipped")),
    ("erc", ("erc",)),
    ("covariance", ("cov",)),
    ("early_stopping", ("early_stopped/",)),
    ("timing", ("time/", "timing/")),
]
MAX_KEYS_PER_AXES = 12
MAX_PANELS = 30


def read_metrics(run_dir: str) -> list[dict]:
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file {path} (a run writes it via tracking.Tracker)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
    return rows


def _series(rows: list[dict]) -> OrderedDict[str, tuple[list, list]]:
    out: OrderedDict = OrderedDict()
    for i, r in enumerate(rows):
        x = r.get("step", i)
        for k, v in r.items():
            if k in SKIP_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(x)
            ys.append(v)
    return out


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the PNG curves; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    series = _series(rows)
    if not series:
        raise ValueError(f"{run_dir}: metrics.jsonl has no numeric metrics to plot")
    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir)
    out_dir = out_dir or os.path.join(base, "plots")
    os.makedirs(out_dir, exist_ok=True)
    n_steps = len(rows)
    written = []

    def draw(ax, k):
        xs, ys = series[k]
        sparse = len(xs) < max(2, n_steps // 2)
        ax.plot(xs, ys, marker="o" if sparse or len(xs) < 3 else None, markersize=3,
                linewidth=1.2, label=k)

    for name, pats in TOPICS:
        keys = [k for k in series if any(p in k.lower() for p in pats)]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k in keys[:MAX_KEYS_PER_AXES]:
            draw(ax, k)
        ax.set_xlabel("step")
        ax.set_title(name.replace("_", " "), y=1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.subplots_adjust(left=0.09, right=0.98, bottom=0.11, top=0.92)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    prefixes: OrderedDict = OrderedDict()
    for k in series:
        prefixes.setdefault(k.split("/", 1)[0] if "/" in k else "misc", []).append(k)
    for p, keys in prefixes.items():
        keys = keys[:MAX_PANELS]
        ncol = min(3, len(keys))
        nrow = math.ceil(len(keys) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 2.8 * nrow), squeeze=False,
                                 sharex=True)
        for i, (ax, k) in enumerate(zip(axes.flat, keys)):
            draw(ax, k)
            ax.set_title(k, fontsize=8, y=1.0)  # a fixed y skips the title auto-placement
            # step labels only under the lowest panel of each column (the x axis is shared)
            ax.tick_params(labelsize=7, labelbottom=i + ncol >= len(keys))
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        # fixed margins: tight_layout measures every tick label and costs more than the drawing
        fig.subplots_adjust(left=0.6 / (4.2 * ncol) * 2, right=0.98, wspace=0.35,
                            bottom=0.35 / (2.8 * nrow) * 2, top=1 - 0.25 / (2.8 * nrow) * 2,
                            hspace=0.45)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in p)
        path = os.path.join(out_dir, f"prefix_{safe}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
