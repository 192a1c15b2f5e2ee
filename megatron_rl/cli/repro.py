"""Layout reproducibility of whole runs: the same config at several TP x PP x DP layouts.

``python -m megatron_rl repro CONFIG --layouts 1x1x1,2x2x1,1x2x2 --steps N`` runs ``train`` once
per layout (separate processes and run directories under ``--out``), reads each run's
``metrics.jsonl`` and compares every logged metric of every step with the first layout's:

    |other - ref| <= atol + rtol * |ref|

except the engine-vs-actor log-prob mismatch diagnostics (``*logp_mismatch*``,
``rollout_corr/kl_k3``): they are rounding-level differences by construction
(~1e-6) whose size depends on the actor's TP sums, so they get an absolute tolerance (1e-4).
Timing and host metrics (``time``, ``wall_s``, ``time/*``, ``gpu/*``, ...) are not compared. A
metric missing in one run, or finite in one and null (NaN/inf) in the other, fails. It prints the
per-step worst differences and a per-metric summary, writes ``repro.json`` and ``repro.png``, and
exits 0 on pass, 1 on fail.

When the config has an SFT warm start (``sft.steps > 0``) it runs once, at the first layout, and
every layout starts RL from those weights (``model.init_weights``): the comparison is of the RL
steps. (Supervised steps drift by rounding like RL steps do; ``--sft-per-layout`` keeps them.)

Why a tolerance and not bit equality: TP splits the row-parallel matmuls' sums and DP splits the
gradient sum, so the order of floating-point additions differs between layouts (step 1 differs at
fp32 rounding level, ~1e-8 relative); training feeds those differences back, and they grow slowly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from megatron_rl.util.progress import Progress, last_logged_step

SKIP_PREFIXES = ("time/", "gpu/", "mem/", "perf/", "throughput/", "system/", "sys/")
SKIP_KEYS = {"time", "wall_s", "step"}
DEFAULT_ATOL, DEFAULT_RTOL = 1e-6, 1e-4
# Engine-vs-actor log-prob mismatch diagnostics are differences of two computations of the same
# log-probs, i.e. rounding-level by construction (~1e-6) and layout-dependent by nature (the
# actor's TP sums vs the engine's): compared with an absolute tolerance in log-prob units.
MISMATCH_PATTERNS = ("logp_mismatch", "rollout_corr/kl_k3")
DEFAULT_MISMATCH_ATOL = 1e-4


def tolerance(key: str, atol: float, rtol: float,
              mismatch_atol: float = DEFAULT_MISMATCH_ATOL) -> tuple[float, float]:
    """(atol, rtol) for ``key``: mismatch diagnostics get ``(mismatch_atol, 0)``."""
    if any(p in key for p in MISMATCH_PATTERNS):
        return mismatch_atol, 0.0
    return atol, rtol


class ReproError(ValueError):
    """Bad repro arguments or a run that did not produce metrics."""


def parse_layouts(text: str) -> list[tuple[int, ...]]:
    """``"1x1x1,2x2x1,1x1x1x2"`` -> ``[(1, 1, 1), (2, 2, 1), (1, 1, 1, 2)]`` (TP x PP x DP, and
    a fourth field CP, context parallelism, when it is given)."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) not in (3, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ReproError(f"--layouts: {item!r} is not TPxPPxDP[xCP] with positive integers "
                             f"(e.g. 2x2x1 or 1x1x1x2)")
        out.append(tuple(int(p) for p in parts))
    if len(out) < 2:
        raise ReproError("--layouts needs at least two layouts to compare")
    return out


def layout_name(layout: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in layout)


def layout_overrides(layout: tuple[int, ...]) -> list[str]:
    """``parallel.*`` overrides of a ``(tp, pp, dp[, cp])`` layout."""
    tp, pp, dp, cp = (*layout, 1)[:4]
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.cp={cp}"]


def layout_label(layout: tuple[int, ...]) -> str:
    """``TP2 x PP2 x DP1`` (``x CP2`` appended with context parallelism)."""
    tp, pp, dp, cp = (*layout, 1)[:4]
    return f"TP{tp} x PP{pp} x DP{dp}" + (f" x CP{cp}" if cp > 1 else "")


def compared(key: str, value) -> bool:
    """Whether a metric takes part in the comparison."""
    if key in SKIP_KEYS or key.startswith(SKIP_PREFIXES):
        return False
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def read_metrics(run_dir: str) -> dict[int, dict]:
    """``metrics.jsonl`` of a run as ``{step: row}`` (the last row of a step wins)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ReproError(f"{path} does not exist (did the run fail? see {run_dir}/train.log)")
    rows: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return rows


@dataclass
class MetricDiff:
    """Per-step absolute differences of one metric against the reference layout."""

    key: str
    steps: list[int] = field(default_factory=list)
    abs_diff: list[float] = field(default_factory=list)
    ref: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def ratio(self, atol: float, rtol: float) -> list[float]:
        """|diff| / (atol + rtol |ref|) per step (this metric's tolerance): <= 1 passes."""
        atol, rtol = tolerance(self.key, atol, rtol)
        return [d / (atol + rtol * abs(r)) for d, r in zip(self.abs_diff, self.ref)]


def compare_runs(ref: dict[int, dict], other: dict[int, dict], atol: float,
                 rtol: float, mismatch_atol: float = DEFAULT_MISMATCH_ATOL
                 ) -> dict[str, MetricDiff]:
    """Every compared metric of every step of ``ref`` against ``other``."""
    out: dict[str, MetricDiff] = {}
    for step in sorted(set(ref) | set(other)):
        a, b = ref.get(step), other.get(step)
        if a is None or b is None:
            md = out.setdefault("<step>", MetricDiff("<step>"))
            md.failures.append(f"step {step} logged by only one run")
            continue
        for key in sorted(set(a) | set(b)):
            va, vb = a.get(key, "missing"), b.get(key, "missing")
            if not (compared(key, va) or compared(key, vb)):
                continue
            md = out.setdefault(key, MetricDiff(key))
            if va == "missing" or vb == "missing":
                md.failures.append(f"step {step}: logged by only one run")
            elif va is None or vb is None:
                if va is not vb:
                    md.failures.append(f"step {step}: {va} vs {vb} (non-finite in one run)")
            else:
                d = abs(float(vb) - float(va))
                md.steps.append(step)
                md.abs_diff.append(d)
                md.ref.append(float(va))
                ka, kr = tolerance(key, atol, rtol, mismatch_atol)
                if not d <= ka + kr * abs(float(va)):
                    md.failures.append(f"step {step}: {va!r} vs {vb!r} (|diff| {d:.3g})")
    return out


def format_comparison(name: str, diffs: dict[str, MetricDiff], atol: float,
                      rtol: float) -> str:
    """Per-step worst metric and per-metric summary of one layout against the reference."""
    lines = [f"== {name}: {len(diffs)} metrics, tolerance |diff| <= {atol:g} + {rtol:g} |ref| "
             f"(log-prob mismatch diagnostics: |diff| <= {DEFAULT_MISMATCH_ATOL:g})"]
    by_step: dict[int, tuple[float, str, float]] = {}
    for md in diffs.values():
        for s, d, r, q in zip(md.steps, md.abs_diff, md.ref, md.ratio(atol, rtol)):
            rel = d / abs(r) if r else (0.0 if d == 0 else math.inf)
            if s not in by_step or q > by_step[s][0]:
                by_step[s] = (q, md.key, rel)
    lines.append(f"  {'step':>4}  {'worst metric':<36} {'rel diff':>10} {'of tol':>8}")
    for s in sorted(by_step):
        q, key, rel = by_step[s]
        lines.append(f"  {s:>4}  {key:<36} {rel:>10.2e} {q:>8.3f}")
    lines.append(f"  {'metric':<36} {'max |diff|':>11} {'max rel':>10} {'at step':>7}  result")
    for key in sorted(diffs):
        md = diffs[key]
        if md.abs_diff:
            i = max(range(len(md.abs_diff)), key=lambda j: md.abs_diff[j])
            rel = [d / abs(r) if r else (0.0 if d == 0 else math.inf)
                   for d, r in zip(md.abs_diff, md.ref)]
            row = f"  {key:<36} {md.abs_diff[i]:>11.3e} {max(rel):>10.2e} {md.steps[i]:>7}"
        else:
            row = f"  {key:<36} {'-':>11} {'-':>10} {'-':>7}"
        lines.append(row + ("  ok" if not md.failures else "  FAIL: " + md.failures[0]))
    return "\n".join(lines)


def passed(diffs: dict[str, MetricDiff]) -> bool:
    return bool(diffs) and not any(md.failures for md in diffs.values())


def plot_comparisons(path: str, comparisons: dict[str, dict[str, MetricDiff]], atol: float,
                     rtol: float) -> str | None:
    """One panel per compared layout: |diff| / tolerance per metric and step (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(comparisons)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.2), squeeze=False)
    for ax, (name, diffs) in zip(axes[0], comparisons.items()):
        for key, md in sorted(diffs.items()):
            q = [max(v, 1e-6) for v in md.ratio(atol, rtol)]
            if q and max(md.abs_diff) > 0:
                ax.plot(md.steps, q, marker=".", lw=0.8, label=key)
        ax.axhline(1.0, color="red", ls="--", lw=1, label="tolerance")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(f"|diff| / ({atol:g} + {rtol:g}|ref|)")
        ax.set_title(name)
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Running the layouts
# --------------------------------------------------------------------------------------------
def _run(cmd: list[str], log_path: str, timeout_s: float,
         poll: Callable[[], None] | None = None) -> None:
    """Run ``cmd`` with its output in ``log_path``; ``poll`` is called every second while it
    runs (progress). Raises :class:`ReproError` when it fails."""
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(var, None)  # each run spawns its own local processes
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                if poll is not None:
                    poll()
                try:
                    proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        raise ReproError(f"{' '.join(cmd[3:5])} failed (exit {proc.returncode}); log "
                         f"{log_path}:\n{tail}")


def run_layouts(config: str | None, overrides: list[str], layouts: list[tuple[int, ...]],
                steps: int, out: str, sft_per_layout: bool = False,
                timeout_s: float = 3600) -> dict[str, str]:
    """Train once per layout; returns ``{layout name: run dir}``."""
    from megatron_rl.config.load import load_config

    cfg = load_config(config, overrides)
    os.makedirs(out, exist_ok=True)
    base = [sys.executable, "-m", "megatron_rl"]
    cfg_arg = [config] if config else []
    common = list(overrides) + [f"trainer.total_steps={steps}", "trainer.resume=false"]
    if cfg.sft.steps > 0 and not sft_per_layout:
        sft_dir = os.path.join(out, "sft")
        print(f"[repro] SFT warm start once at {layout_name(layouts[0])} -> {sft_dir}",
              flush=True)
        _run(base + ["sft"] + cfg_arg + list(overrides) + layout_overrides(layouts[0]) + [
            f"trainer.output_dir={sft_dir}"], os.path.join(out, "sft.log"), timeout_s)
        common += [f"model.init_weights={os.path.join(sft_dir, 'sft_weights.pt')}",
                   "sft.steps=0"]
    runs = {}
    bar = Progress(steps * len(layouts), "repro", unit="steps", every_s=60.0)
    for i, layout in enumerate(layouts):
        name = layout_name(layout)
        run_dir = os.path.join(out, name)
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not appended metrics
        print(f"[repro] training {steps} steps at {layout_label(layout)} -> {run_dir}",
              flush=True)

        def poll(i: int = i, run_dir: str = run_dir, name: str = name) -> None:
            bar.set(i * steps + min(steps, last_logged_step(run_dir)),
                    info=f"layout {i + 1}/{len(layouts)} ({name})")

        _run(base + ["train"] + cfg_arg + common + layout_overrides(layout) + [
            f"trainer.output_dir={run_dir}"], os.path.join(out, f"{name}.log"), timeout_s, poll)
        bar.set((i + 1) * steps)
        runs[name] = run_dir
    bar.close()
    return runs


def compare_dirs(runs: dict[str, str], atol: float, rtol: float,
                 out: str | None = None) -> tuple[bool, str]:
    """Compare every run with the first; (pass, report). Writes repro.json/png under ``out``."""
    names = list(runs)
    ref = read_metrics(runs[names[0]])
    comparisons = {f"{n} vs {names[0]}": compare_runs(ref, read_metrics(runs[n]), atol, rtol)
                   for n in names[1:]}
    report = [format_comparison(k, v, atol, rtol) for k, v in comparisons.items()]
    ok = all(passed(v) for v in comparisons.values())
    report.append(f"repro: {'PASS' if ok else 'FAIL'} ({len(ref)} logged steps, layouts "
                  f"{', '.join(names)}; tolerance |diff| <= {atol:g} + {rtol:g} |ref|)")
    if out:
        with open(os.path.join(out, "repro.json"), "w") as f:
            json.dump({"pass": ok, "atol": atol, "rtol": rtol, "layouts": names,
                       "comparisons": {k: {m: {"steps": d.steps, "abs_diff": d.abs_diff,
                                               "ref": d.ref, "failures": d.failures}
                                           for m, d in v.items()}
                                       for k, v in comparisons.items()}}, f, indent=1)
        png = plot_comparisons(os.path.join(out, "repro.png"), comparisons, atol, rtol)
        if png:
            report.append(f"plot: {png}")
    return ok, "\n".join(report)


def _cmd_repro(args) -> int:
    from megatron_rl.config.errors import ConfigError

    try:
        layouts = parse_layouts(args.layouts)
        if args.steps < 1:
            raise ReproError("--steps must be >= 1")
        if args.compare_only:
            runs = {layout_name(lay): os.path.join(args.out, layout_name(lay))
                    for lay in layouts}
        else:
            runs = run_layouts(args.config, args.overrides, layouts, args.steps, args.out,
                               args.sft_per_layout)
        ok, report = compare_dirs(runs, args.atol, args.rtol, args.out)
    except (ReproError, ConfigError, subprocess.TimeoutExpired) as exc:
        print(f"repro error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0 if ok else 1


def add_repro_subcommand(sub) -> None:
    """Register ``repro`` on the CLI's subparsers."""
    p = sub.add_parser("repro", help="run a config at several TPxPPxDP layouts and compare "
                                     "every logged metric step by step")
    p.add_argument("config", nargs="?", default=None, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--layouts", default="1x1x1,2x2x1,1x2x2",
                   help="comma-separated TPxPPxDP[xCP] layouts; the first is the reference")
    p.add_argument("--steps", type=int, default=10, help="RL steps per run")
    p.add_argument("--out", default="runs/repro", help="directory of the runs and the report")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                   help=f"absolute tolerance per metric (default {DEFAULT_ATOL:g})")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"relative tolerance per metric (default {DEFAULT_RTOL:g})")
    p.add_argument("--sft-per-layout", action="store_true",
                   help="run the SFT warm start at every layout (default: once, shared)")
    p.add_argument("--compare-only", action="store_true",
                   help="compare existing runs under --out without training")
    p.set_defaults(func=_cmd_repro)
