"""Sweeps: one base config x one changed axis per sweep -> runs, a report and plots.

A sweep file (YAML)::

    base: ../tiny_frozenlake.yaml        # run config, relative to this file
    overrides: {trainer.total_steps: 20} # dotted keys applied to every run (optional)
    output_dir: runs/sweeps/rv_tiny      # default: runs/sweeps/<file stem>; output_dir=... on the
                                         # command line overrides it
    parallel_runs: 1                     # runs executed at the same time
    seeds: [1, 2, 3]                     # optional: every condition once per seed
    seed_key: trainer.seed               # the key the seed sets (default trainer.seed)
    collapse: {metric: policy/entropy, fraction: 0.5}  # "steps to collapse" (study report)
    sweeps:
      - name: rv_filter
        axis: rollout.rv_filter_p        # the one changed key (labels the table)
        values: [1.0, 0.9]               # one condition per value: {axis: value}
        conditions:                      # and/or named conditions setting several keys
          nofilter: {rollout.rv_filter_p: 1.0, rollout.rv_include_zero: true}
        grid: {rollout.max_staleness: [0, 1]}  # optional: every condition x every grid point

Every condition's config is loaded (and so validated) before anything runs. Each run is
``python -m megatron_rl train BASE key=value ... output_dir=OUT/<sweep>/<condition>`` with its log
in ``train.log``; a run that finished writes ``sweep_done.json`` and is skipped on a restart
(an interrupted run resumes from its own checkpoint, ``trainer.resume``). Afterwards
``OUT/report.md`` holds one table per sweep (best and final validation success, steps trained,
early stop and why) and ``OUT/plots/<sweep>_<metric>.png`` one line per condition for the
validation success, the policy entropy, the KL to the reference and the in-group reward std.
With ``seeds`` or a ``grid`` the report adds the study's summary table and curves over seeds
(:mod:`megatron_rl.cli.study`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import yaml

from megatron_rl.cli.sweep_plan import (
    DONE,
    Condition,
    SweepPlan,
    _finite,
    _slug,
    is_done,
    read_rows,
)
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config
from megatron_rl.config.overrides import closest_name
from megatron_rl.util.progress import Progress, last_logged_step

PLOT_METRICS = (("val_success", "val/acc", "validation success"),
                ("entropy", "policy/entropy", "policy entropy"),
                ("kl_to_ref", "kl/mean", "KL to the reference"),
                ("reward_std", "rollout/in_group_reward_std", "in-group reward std"))
STOP_KEYS = {"early_stopped/reward_variance_collapse": "reward-variance collapse",
             "early_stopped/validation_collapse": "validation success collapse"}


def _as_override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value) if not isinstance(value, str) else value}"


def load_sweep(path: str, extra: list[str] | None = None) -> SweepPlan:
    """Parse and validate a sweep file; every condition's run config is loaded once here.
    ``extra``: ``key=value`` overrides for every run (e.g. ``model.hf_path=/my/model``)."""
    try:
        with open(path) as f:
            spec = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path!r} does not exist") from None
    known = {"base", "overrides", "output_dir", "parallel_runs", "sweeps", "seeds", "seed_key",
             "collapse"}
    bad = sorted(set(spec) - known)
    if bad:
        raise ConfigError(f"{path}: unknown sweep key(s) {bad}{closest_name(bad[0], known)} "
                          f"(allowed: {sorted(known)})")
    if "base" not in spec or not spec.get("sweeps"):
        raise ConfigError(f"{path}: a sweep file needs 'base' (a run config) and 'sweeps'")
    base = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), spec["base"]))
    stem = os.path.splitext(os.path.basename(path))[0]
    extra = list(extra or [])
    out_cli = [x.split("=", 1)[1] for x in extra if x.startswith("output_dir=")]
    extra = [x for x in extra if not x.startswith("output_dir=")]
    plan = SweepPlan(base=base, output_dir=(out_cli[-1] if out_cli else None)
                     or spec.get("output_dir") or f"runs/sweeps/{stem}",
                     parallel_runs=int(spec.get("parallel_runs", 1)))
    if plan.parallel_runs < 1:
        raise ConfigError(f"{path}: parallel_runs must be >= 1")
    plan.seeds = _seeds(path, spec.get("seeds"))
    seed_key = str(spec.get("seed_key", "trainer.seed"))
    _collapse(path, spec.get("collapse"), plan)
    common = dict(spec.get("overrides") or {})
    for item in extra or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        common[key.strip()] = yaml.safe_load(raw) if raw else ""
    for i, sw in enumerate(spec["sweeps"]):
        if not isinstance(sw, dict) or "name" not in sw:
            raise ConfigError(f"{path}: sweeps[{i}] must be a mapping with a 'name'")
        allowed = ("name", "axis", "values", "conditions", "grid")
        extra = sorted(set(sw) - set(allowed))
        if extra:
            raise ConfigError(f"{path}: sweeps[{i}] has unknown key(s) {extra}"
                              f"{closest_name(extra[0], allowed)} (allowed: {', '.join(allowed)})")
        name, axis = str(sw["name"]), sw.get("axis")
        if name in plan.sweeps:
            raise ConfigError(f"{path}: two sweeps are named {name!r}")
        plan.sweeps[name] = str(axis or "")
        conds: list[tuple[str, dict]] = []
        if sw.get("values") is not None:
            if not axis:
                raise ConfigError(f"{path}: sweeps[{i}] ({name}) has 'values' but no 'axis'")
            conds += [(f"{axis.split('.')[-1]}={v}", {axis: v}) for v in sw["values"]]
        for cname, sets in (sw.get("conditions") or {}).items():
            if not isinstance(sets, dict):
                raise ConfigError(f"{path}: condition {cname!r} of {name} must map keys to values")
            conds.append((str(cname), dict(sets)))
        if not conds:
            raise ConfigError(f"{path}: sweep {name} has no conditions (give values or "
                              "conditions)")
        plan.grids[name] = _grid(path, name, sw.get("grid"))
        crossed = _cross(conds, plan.grids[name])
        for seed in plan.seeds or [None]:  # seed-major: a cut-short study covers every group
            for label, cname, sets in crossed:
                c = Condition(name, cname, {**common, **sets}, label=label, group=cname,
                              point={k: sets[k] for k in plan.grids[name]}, seed=seed)
                c.run_dir = os.path.join(plan.output_dir, _slug(name), _slug(cname))
                if seed is not None:
                    c.name = f"{cname} seed={seed}"
                    c.overrides[seed_key] = seed
                    c.run_dir = os.path.join(c.run_dir, f"seed={seed}")
                try:
                    c.total_steps = load_config(base, run_overrides(c)).trainer.total_steps
                except ConfigError as exc:
                    raise ConfigError(f"{path}: sweep {name}, condition {c.name}: {exc}") from None
                plan.conditions.append(c)
    return plan


def _seeds(path: str, raw: Any) -> list[int]:
    """``seeds``: a list of distinct ints (absent: [])."""
    if raw is None:
        return []
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
            or len(set(raw)) != len(raw)):
        raise ConfigError(f"{path}: seeds must be a non-empty list of distinct ints, got {raw!r}")
    return list(raw)


def _collapse(path: str, raw: Any, plan: SweepPlan) -> None:
    """``collapse: {metric, fraction}``: the definition of "steps to collapse" (study report)."""
    if raw is None:
        return
    if not isinstance(raw, dict) or set(raw) - {"metric", "fraction"}:
        raise ConfigError(f"{path}: collapse must be a mapping with 'metric' and/or 'fraction', "
                          f"got {raw!r}")
    plan.collapse_metric = str(raw.get("metric", plan.collapse_metric))
    frac = raw.get("fraction", plan.collapse_fraction)
    if not _finite(frac) or not 0 < frac < 1:
        raise ConfigError(f"{path}: collapse.fraction must be a number in (0, 1), got {frac!r}")
    plan.collapse_fraction = float(frac)


def _grid(path: str, sweep: str, raw: Any) -> dict[str, list]:
    """A sweep's ``grid``: dotted key -> non-empty list of values (absent: {})."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, list) and v for v in raw.values()):
        raise ConfigError(f"{path}: sweep {sweep}: grid must map keys to non-empty lists of "
                          f"values, got {raw!r}")
    return {str(k): list(v) for k, v in raw.items()}


def _cross(conds: list[tuple[str, dict]],
           grid: dict[str, list]) -> list[tuple[str, str, dict]]:
    """Every condition at every grid point: ``(label, name, sets)`` with the name
    ``label,key=value,...`` (the key's last component); the grid overrides a condition's key."""
    out = [(n, n, sets) for n, sets in conds]
    for key, values in grid.items():
        short = key.split(".")[-1]
        out = [(lab, f"{n},{short}={v}", {**sets, key: v}) for lab, n, sets in out
               for v in values]
    return out


def run_overrides(c: Condition) -> list[str]:
    """The ``key=value`` overrides of one run (its output directory last)."""
    return [_as_override(k, v) for k, v in c.overrides.items()] + [
        f"trainer.output_dir={c.run_dir}"]


def _launch(plan: SweepPlan, c: Condition) -> subprocess.Popen:
    os.makedirs(c.run_dir, exist_ok=True)
    log = open(os.path.join(c.run_dir, "train.log"), "a")
    cmd = [sys.executable, "-m", "megatron_rl", "train", plan.base, *run_overrides(c)]
    print(f"[sweep] start {c.sweep}/{c.name}: {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _finish(c: Condition, proc: subprocess.Popen, t0: float) -> bool:
    proc.log.close()  # type: ignore[attr-defined]
    if proc.returncode != 0:
        print(f"[sweep] FAILED {c.sweep}/{c.name} (exit {proc.returncode}); see "
              f"{os.path.join(c.run_dir, 'train.log')}", flush=True)
        return False
    with open(os.path.join(c.run_dir, DONE) + ".tmp", "w") as f:
        json.dump({"sweep": c.sweep, "condition": c.name, "overrides": c.overrides,
                   "wall_s": time.time() - t0}, f)
    os.replace(os.path.join(c.run_dir, DONE) + ".tmp", os.path.join(c.run_dir, DONE))
    print(f"[sweep] done {c.sweep}/{c.name} ({time.time() - t0:.0f}s)", flush=True)
    return True


def execute(plan: SweepPlan, parallel_runs: int | None = None) -> list[Condition]:
    """Run every unfinished condition (``parallel_runs`` at a time); returns the failed ones."""
    todo = []
    for c in plan.conditions:
        if is_done(c):
            print(f"[sweep] skip finished run {c.sweep}/{c.name}", flush=True)
        else:
            todo.append(c)
    width = parallel_runs or plan.parallel_runs
    running: list[tuple[Condition, subprocess.Popen, float]] = []
    failed: list[Condition] = []
    bar = Progress(sum(c.total_steps for c in todo), "sweep", unit="steps", every_s=60.0)
    finished_steps, n_runs, n_done = 0, len(todo), 0
    while todo or running:
        while todo and len(running) < width:
            c = todo.pop(0)
            running.append((c, _launch(plan, c), time.time()))
        time.sleep(0.5)
        for item in list(running):
            c, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                finished_steps += c.total_steps  # an early stop counts as all its steps
                n_done += 1
                if not _finish(c, proc, t0):
                    failed.append(c)
        live = sum(min(last_logged_step(c.run_dir), c.total_steps) for c, _, _ in running)
        bar.set(finished_steps + live, info=f"{n_done}/{n_runs} runs finished")
    bar.close()
    return failed


# ---- report ------------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> dict[str, Any]:
    """Best/final validation success, steps trained and the early stop (reason) of one run."""
    vals = [r["val/acc"] for r in rows if _finite(r.get("val/acc"))]
    steps = max([int(r["step"]) for r in rows if "step" in r] or [0])
    reasons = sorted({text for r in rows for k, text in STOP_KEYS.items()
                      if _finite(r.get(k)) and r[k] > 0})
    return {"best_val": max(vals) if vals else None, "final_val": vals[-1] if vals else None,
            "steps": steps, "early_stopped": bool(reasons), "reason": ", ".join(reasons)}


def _fmt(v: Any) -> str:
    return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def write_report(plan: SweepPlan) -> str:
    """``OUTPUT_DIR/report.md`` and the plots; returns the report's path."""
    os.makedirs(plan.output_dir, exist_ok=True)
    lines = ["# Sweep report", "", f"Base config: `{os.path.relpath(plan.base)}`", ""]
    for sweep, axis in plan.sweeps.items():
        conds = [c for c in plan.conditions if c.sweep == sweep]
        lines += [f"## {sweep}" + (f" (axis `{axis}`)" if axis else ""), "",
                  "| condition | best val success | final val success | steps trained | "
                  "early-stopped (why) | finished |",
                  "|---|---|---|---|---|---|"]
        for c in conds:
            s = summarize(read_rows(c.run_dir))
            stop = f"yes ({s['reason']})" if s["early_stopped"] else "no"
            lines.append(f"| {c.name} | {_fmt(s['best_val'])} | {_fmt(s['final_val'])} | "
                         f"{s['steps']} | {stop} | {'yes' if is_done(c) else 'no'} |")
        if plan.is_study:
            from megatron_rl.cli.study import plot_study, study_table

            lines += ["", *study_table(plan, sweep)]
            plots = plot_study(plan, sweep)
        else:
            plots = plot_sweep(plan, sweep)
        lines += [""] + [f"![{os.path.basename(p)}](plots/{os.path.basename(p)})" for p in plots]
        lines.append("")
    path = os.path.join(plan.output_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def plot_sweep(plan: SweepPlan, sweep: str) -> list[str]:
    """One PNG per metric of :data:`PLOT_METRICS`, one line per condition (metrics no run has
    are skipped, e.g. the KL when no condition uses a reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = os.path.join(plan.output_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    runs = [(c.name, read_rows(c.run_dir)) for c in plan.conditions if c.sweep == sweep]
    paths = []
    for tag, key, title in PLOT_METRICS:
        series = [(name, [(r["step"], r[key]) for r in rows if "step" in r and _finite(r.get(key))])
                  for name, rows in runs]
        series = [(n, pts) for n, pts in series if pts]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5.0, 3.2), dpi=80)
        for name, pts in series:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
        ax.set_xlabel("step")
        ax.set_title(f"{sweep}: {title}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{_slug(sweep)}_{tag}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def run_sweep(path: str, parallel_runs: int | None = None, report_only: bool = False,
              extra: list[str] | None = None) -> int:
    """The ``sweep`` command: execute (unless ``report_only``), then write the report."""
    plan = load_sweep(path, extra)
    print(f"[sweep] {len(plan.conditions)} run(s) in {len(plan.sweeps)} sweep(s) -> "
          f"{plan.output_dir}", flush=True)
    failed = [] if report_only else execute(plan, parallel_runs)
    report = write_report(plan)
    print(f"[sweep] report: {report}", flush=True)
    return 1 if failed else 0
