"""Study sweeps (issue 44, item 3): ``seeds`` and a sweep ``grid`` expand to one run per
(condition, grid point, seed); the report aggregates over seeds (final accuracy, pass@k and
entropy as mean ± sample standard deviation, steps to collapse per seed) and draws the curves
side by side. Everything here is single-process, on hand-written metrics files."""

import json
import math
import os

import pytest

from megatron_rl.cli.study import mean_curve, mean_spread, steps_to_collapse
from megatron_rl.cli.sweep import DONE, load_sweep, write_report
from megatron_rl.config.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "tiny_dapo.yaml")
STUDY = ("seeds: [1, 2]\ncollapse: {fraction: 0.5}\nsweeps:\n  - name: fr\n"
         "    axis: loss.algorithm\n    grid: {rollout.max_staleness: [0, 1]}\n"
         "    conditions:\n      dapo: {loss.algorithm: dapo}\n"
         "      bapo: {loss.algorithm: bapo}\n")


def write_study(tmp_path, body: str = STUDY) -> str:
    path = tmp_path / "study.yaml"
    path.write_text(f"base: {BASE}\noutput_dir: {tmp_path / 'out'}\n"
                    "overrides: {parallel.tp: 1, parallel.pp: 1}\n" + body)
    return str(path)


def test_study_sweep_expands_seeds_and_grid_seed_major(tmp_path):
    plan = load_sweep(write_study(tmp_path))
    assert plan.is_study and plan.seeds == [1, 2]
    assert [c.name for c in plan.conditions] == [
        "dapo,max_staleness=0 seed=1", "dapo,max_staleness=1 seed=1",
        "bapo,max_staleness=0 seed=1", "bapo,max_staleness=1 seed=1",
        "dapo,max_staleness=0 seed=2", "dapo,max_staleness=1 seed=2",
        "bapo,max_staleness=0 seed=2", "bapo,max_staleness=1 seed=2"]
    c = plan.conditions[3]
    assert (c.label, c.group, c.point, c.seed) == ("bapo", "bapo,max_staleness=1",
                                                   {"rollout.max_staleness": 1}, 1)
    assert c.overrides["trainer.seed"] == 1 and c.overrides["rollout.max_staleness"] == 1
    assert c.overrides["loss.algorithm"] == "bapo"
    assert c.run_dir == str(tmp_path / "out" / "fr" / "bapo_max_staleness=1" / "seed=1")
    assert [c.overrides["trainer.seed"] for c in plan.conditions] == [1] * 4 + [2] * 4


@pytest.mark.parametrize("body,match", [
    ("seeds: [1, 1]\n", "distinct ints"),
    ("seeds: 3\n", "distinct ints"),
    ("collapse: {fraction: 1.5}\n", r"collapse.fraction must be a number in \(0, 1\)"),
    ("collapse: {metrc: x}\n", "collapse must be a mapping"),
])
def test_study_sweep_refuses_bad_seeds_and_collapse(tmp_path, body, match):
    path = write_study(tmp_path, body + "sweeps:\n  - name: a\n    values: [dapo]\n"
                       "    axis: loss.algorithm\n")
    with pytest.raises(ConfigError, match=match):
        load_sweep(path)


def test_study_sweep_refuses_bad_grid(tmp_path):
    path = write_study(tmp_path, "sweeps:\n  - name: a\n    axis: loss.algorithm\n"
                       "    values: [dapo]\n    grid: {rollout.max_staleness: []}\n")
    with pytest.raises(ConfigError, match="grid must map keys to non-empty lists"):
        load_sweep(path)
    path = write_study(tmp_path, "sweeps:\n  - name: a\n    axis: loss.algorithm\n"
                       "    values: [dapo]\n    grid: {rollout.max_staleness: [0, 99]}\n")
    with pytest.raises(ConfigError, match="condition algorithm=dapo,max_staleness=99: "
                       ".*max_staleness"):
        load_sweep(path)


def test_study_steps_to_collapse_definition():
    rows = [{"step": 0, "val/acc": 0.5},  # no entropy at step 0 (before RL)
            {"step": 1, "policy/entropy": 0.8}, {"step": 2, "policy/entropy": 0.41},
            {"step": 3, "policy/entropy": 0.4}, {"step": 4, "policy/entropy": 0.3}]
    assert steps_to_collapse(rows, fraction=0.5) == 4  # 0.4 is not below 0.5 * 0.8
    assert steps_to_collapse(rows, fraction=0.6) == 2
    assert steps_to_collapse(rows, fraction=0.3) is None
    assert steps_to_collapse([{"step": 1, "policy/entropy": 0.0},
                              {"step": 2, "policy/entropy": 0.0}]) is None
    assert steps_to_collapse([]) is None
    # the metric is configurable; rows are read in step order
    assert steps_to_collapse([{"step": 2, "x": 1.0}, {"step": 1, "x": 4.0}], "x", 0.5) == 2


def test_study_mean_spread_and_mean_curve():
    m, sd, n = mean_spread([0.5, None, 0.7, 0.9])
    assert (round(m, 12), n) == (0.7, 3) and sd == pytest.approx(0.2)  # sqrt(0.08 / 2)
    assert mean_spread([0.25]) == (0.25, 0.0, 1) and mean_spread([None]) is None
    runs = [[{"step": 1, "k": 1.0}, {"step": 2, "k": 3.0}], [{"step": 1, "k": 2.0}]]
    assert mean_curve(runs, "k") == [(1, 1.5, 1.0, 2.0), (2, 3.0, 3.0, 3.0)]


def _record(run_dir, entropies, accs, pass1, done=True):
    """A run's ``metrics.jsonl``: entropy every step from 1, val/acc and pass@k at the steps of
    ``accs``/``pass1`` (dicts step -> value)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        steps = sorted(set(range(1, len(entropies) + 1)) | set(accs) | set(pass1))
        for s in steps:
            row = {"step": s}
            if 1 <= s <= len(entropies):
                row["policy/entropy"] = entropies[s - 1]
            if s in accs:
                row["val/acc"] = accs[s]
            if s in pass1:
                row["eval/cs/pass@1"] = pass1[s]
                row["eval/cs/pass@8"] = min(1.0, 2 * pass1[s])
            f.write(json.dumps(row) + "\n")
    if done:
        open(os.path.join(run_dir, DONE), "w").write("{}")


def _table_row(report: str, label: str, point: str) -> list[str]:
    line = next(x for x in report.splitlines()
                if x.startswith(f"| {label} | {point} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_study_report_summary_over_seeds_on_recorded_metrics(tmp_path):
    plan = load_sweep(write_study(tmp_path))
    by_name = {c.name: c for c in plan.conditions}
    # dapo, staleness 0: seed 1 collapses at step 3, seed 2 never
    _record(by_name["dapo,max_staleness=0 seed=1"].run_dir, [1.0, 0.6, 0.4, 0.3],
            {0: 0.5, 4: 0.6}, {0: 0.3, 4: 0.4})
    _record(by_name["dapo,max_staleness=0 seed=2"].run_dir, [1.0, 0.9, 0.8, 0.7],
            {0: 0.5, 4: 0.8}, {0: 0.3, 4: 0.45})
    # bapo, staleness 1: one seed recorded, not finished (it would have collapsed at step 2)
    _record(by_name["bapo,max_staleness=1 seed=1"].run_dir, [0.5, 0.2],
            {0: 0.4, 2: 0.25}, {}, done=False)
    report = open(write_report(plan)).read()
    assert "### Summary over seeds (fr)" in report
    header = next(x for x in report.splitlines() if x.startswith("| condition | `rollout"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "condition", "`rollout.max_staleness`", "runs finished", "final val acc",
        "final cs/pass@1", "final cs/pass@8", "entropy at the end",
        "steps to collapse (per seed)", "steps trained"]
    sd_acc = math.sqrt(2 * 0.1**2)  # 0.6 and 0.8 around 0.7
    assert _table_row(report, "dapo", "0") == [
        "dapo", "0", "2/2", f"0.700 ± {sd_acc:.3f}", f"0.425 ± {math.sqrt(2 * 0.025**2):.3f}",
        f"0.850 ± {math.sqrt(2 * 0.05**2):.3f}", f"0.500 ± {math.sqrt(2 * 0.2**2):.3f}",
        "1/2 (3, —)", "4, 4"]
    # an unfinished run counts in "steps trained" only
    assert _table_row(report, "bapo", "1") == [
        "bapo", "1", "0/2", "—", "—", "—", "—", "0/0", "2, 0"]
    assert _table_row(report, "dapo", "1")[2:4] == ["0/2", "—"]
    assert "`policy/entropy` is below 0.5 × its value" in report
    # the per-run table is still there, and the curves are one figure side by side
    assert "| dapo,max_staleness=0 seed=1 | 0.600 | 0.600 | 4 | no | yes |" in report
    assert os.listdir(tmp_path / "out" / "plots") == ["fr_study.png"]
    assert "![fr_study.png](plots/fr_study.png)" in report
    assert (tmp_path / "out" / "plots" / "fr_study.png").stat().st_size > 5000
