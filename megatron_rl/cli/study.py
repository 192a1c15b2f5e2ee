"""The study part of a sweep report: runs that differ only by seed are aggregated.

A sweep file with ``seeds`` (and/or a sweep ``grid``, e.g. ``rollout.max_staleness: [0, 1]``)
is a study: every (condition, grid point) is a *group* of runs, one per seed. For each group the
report gives over its finished runs (:func:`study_table`)

- the final validation accuracy (``val/acc``, the last value logged) as mean ± spread over
  seeds; the spread is the sample standard deviation (n - 1; 0 for one seed);
- the final ``eval/<set>/pass@k`` of every evaluation set and k, mean ± spread;
- the entropy at the end: the last logged ``policy/entropy``, mean ± spread;
- the steps to collapse of every seed (:func:`steps_to_collapse`);

and :func:`plot_study` draws the entropy, validation accuracy and pass@k curves side by side
(one column per metric, one row per grid point, one line per condition: the mean over seeds,
shaded from the lowest to the highest seed).

**Steps to collapse**: with ``e_1`` the collapse metric (``collapse.metric``, default
``policy/entropy``) at the first step that logs it, a run collapses at the first step ``t``
with ``e_t < fraction * e_1`` (``collapse.fraction``, default 0.5); a run that never falls
below it has no collapse step ("—").
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from megatron_rl.cli.sweep_plan import Condition, SweepPlan, _finite, _slug, is_done, read_rows

ACC_KEY = "val/acc"
ENTROPY_KEY = "policy/entropy"
PASS_RE = re.compile(r"^eval/(?P<set>.+)/pass@(?P<k>\d+)$")


def steps_to_collapse(rows: list[dict], metric: str = ENTROPY_KEY,
                      fraction: float = 0.5) -> int | None:
    """First step whose ``metric`` is below ``fraction`` x its value at the first step that
    logs it (None: never, or no positive start value)."""
    pts = series(rows, metric)
    if not pts or not pts[0][1] > 0:
        return None
    threshold = fraction * pts[0][1]
    return next((step for step, v in pts if v < threshold), None)


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row that logs a finite ``key``, in step order."""
    return sorted((int(r["step"]), float(r[key])) for r in rows
                  if "step" in r and _finite(r.get(key)))


def final(rows: list[dict], key: str) -> float | None:
    """The value of ``key`` at the last step that logs it."""
    pts = series(rows, key)
    return pts[-1][1] if pts else None


def pass_keys(rows_by_run: list[list[dict]]) -> list[str]:
    """Every ``eval/<set>/pass@k`` key any run logs, by set then k."""
    found = {k for rows in rows_by_run for r in rows for k in r if PASS_RE.match(k)}
    return sorted(found, key=lambda k: (PASS_RE.match(k)["set"], int(PASS_RE.match(k)["k"])))


def mean_spread(values: list[float | None]) -> tuple[float, float, int] | None:
    """Mean, sample standard deviation (n - 1; 0 for one value) and count of the values that
    are not None (None when there are none)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd, len(xs)


def _pm(stat: tuple[float, float, int] | None) -> str:
    return "—" if stat is None else f"{stat[0]:.3f} ± {stat[1]:.3f}"


def groups(plan: SweepPlan, sweep: str) -> list[list[Condition]]:
    """The sweep's runs grouped by condition and grid point (seeds together), in file order."""
    out: dict[str, list[Condition]] = {}
    for c in plan.conditions:
        if c.sweep == sweep:
            out.setdefault(c.group, []).append(c)
    return list(out.values())


def summarize_group(runs: list[list[dict]], keys: list[str], metric: str,
                    fraction: float) -> dict[str, Any]:
    """One group's row: final accuracy, final pass@k (``keys``), final entropy (mean, spread,
    count) and every run's steps to collapse."""
    return {"acc": mean_spread([final(r, ACC_KEY) for r in runs]),
            "pass": {k: mean_spread([final(r, k) for r in runs]) for k in keys},
            "entropy": mean_spread([final(r, ENTROPY_KEY) for r in runs]),
            "collapse": [steps_to_collapse(r, metric, fraction) for r in runs]}


def study_table(plan: SweepPlan, sweep: str) -> list[str]:
    """Markdown lines: the summary over seeds of one sweep, one row per (condition, grid
    point), and the definitions it uses."""
    grid_keys = list(plan.grids.get(sweep, {}))
    grps = groups(plan, sweep)
    rows_of = {c.run_dir: read_rows(c.run_dir) for g in grps for c in g}
    keys = pass_keys(list(rows_of.values()))
    head = (["condition"] + [f"`{k}`" for k in grid_keys]
            + ["runs finished", "final val acc"] + [f"final {k[len('eval/'):]}" for k in keys]
            + ["entropy at the end", "steps to collapse (per seed)", "steps trained"])
    lines = [f"### Summary over seeds ({sweep})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in grps:
        done = [c for c in g if is_done(c)]
        s = summarize_group([rows_of[c.run_dir] for c in done], keys, plan.collapse_metric,
                            plan.collapse_fraction)
        collapsed = sum(x is not None for x in s["collapse"])
        per_seed = ", ".join("—" if x is None else str(x) for x in s["collapse"])
        steps = [max([int(x["step"]) for x in rows_of[c.run_dir] if "step" in x] or [0])
                 for c in g]
        cells = ([g[0].label or g[0].group] + [str(g[0].point.get(k)) for k in grid_keys]
                 + [f"{len(done)}/{len(g)}", _pm(s["acc"])]
                 + [_pm(s["pass"][k]) for k in keys]
                 + [_pm(s["entropy"]), f"{collapsed}/{len(done)}" + (f" ({per_seed})" if done
                                                                     else ""),
                    ", ".join(str(x) for x in steps)])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Summary columns are over the finished runs: each run's last logged value, "
              f"as mean ± sample standard deviation over seeds. Steps to collapse: the first "
              f"step at which "
              f"`{plan.collapse_metric}` is below {plan.collapse_fraction:g} × its value at the "
              f"run's first logged step (— : never)."]
    return lines


def mean_curve(runs: list[list[dict]], key: str) -> list[tuple[int, float, float, float]]:
    """``(step, mean, min, max)`` over the runs that log ``key`` at each step."""
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for step, v in series(rows, key):
            by_step.setdefault(step, []).append(v)
    return [(s, sum(v) / len(v), min(v), max(v)) for s, v in sorted(by_step.items())]


def plot_study(plan: SweepPlan, sweep: str) -> list[str]:
    """``plots/<sweep>_study.png``: columns entropy, validation accuracy and each pass@k; rows
    the grid points; one line per condition (mean over seeds, band min..max). Returns [] when
    no run has logged anything yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grps = groups(plan, sweep)
    rows_of = {c.run_dir: read_rows(c.run_dir) for g in grps for c in g}
    metrics = [(ENTROPY_KEY, "policy entropy"), (ACC_KEY, "validation accuracy")]
    metrics += [(k, k[len("eval/"):]) for k in pass_keys(list(rows_of.values()))]
    points: list[tuple] = []
    for g in grps:
        pt = tuple(sorted(g[0].point.items()))
        if pt not in points:
            points.append(pt)
    labels = list(dict.fromkeys(g[0].label or g[0].group for g in grps))
    colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    if not any(series(rows, k) for rows in rows_of.values() for k, _ in metrics):
        return []
    fig, axes = plt.subplots(len(points), len(metrics), squeeze=False, dpi=80,
                             figsize=(3.6 * len(metrics), 2.8 * len(points)))
    for i, pt in enumerate(points):
        where = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in pt)
        for j, (key, title) in enumerate(metrics):
            ax = axes[i][j]
            for g in grps:
                if tuple(sorted(g[0].point.items())) != pt:
                    continue
                curve = mean_curve([rows_of[c.run_dir] for c in g], key)
                if not curve:
                    continue
                lab = g[0].label or g[0].group
                xs, ys, lo, hi = zip(*curve)
                ax.plot(xs, ys, color=colors[lab], label=lab,
                        marker="o" if len(xs) < 15 else None, markersize=3)
                ax.fill_between(xs, lo, hi, color=colors[lab], alpha=0.15, linewidth=0)
            ax.set_title(f"{title}" + (f" ({where})" if where else ""), fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out_dir = os.path.join(plan.output_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{_slug(sweep)}_study.png")
    fig.savefig(path)
    plt.close(fig)
    return [path]
