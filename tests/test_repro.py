"""Layout reproducibility runs: the comparison rules, and a real two-layout run of a tiny recipe
that passes and fails once a difference is injected into one run's metrics."""

from __future__ import annotations

import json
import os

import pytest

from megatron_rl.cli.app import main
from megatron_rl.cli.repro import (
    ReproError,
    compare_dirs,
    compare_runs,
    layout_label,
    layout_overrides,
    parse_layouts,
    passed,
    read_metrics,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_layouts():
    assert parse_layouts("1x1x1, 2x2x1") == [(1, 1, 1), (2, 2, 1)]
    assert parse_layouts("1x1x1,1x1x1x2") == [(1, 1, 1), (1, 1, 1, 2)]  # CP as a 4th field
    assert layout_overrides((1, 1, 1, 2))[-1] == "parallel.cp=2"
    assert layout_label((1, 2, 1, 2)) == "TP1 x PP2 x DP1 x CP2"
    for bad in ("1x1", "1x1x1", "2x0x1,1x1x1", "ax1x1,1x1x1"):
        with pytest.raises(ReproError, match="layout"):
            parse_layouts(bad)


def _rows(**metrics) -> dict[int, dict]:
    return {1: {"step": 1, "time": 5.0, "wall_s": 1.0, "time/update": 0.3, **metrics}}


def test_compare_rules():
    ref = _rows(**{"actor/loss": 0.5, "actor/grad_norm": 2.0, "val/acc": None})
    same = _rows(**{"actor/loss": 0.5, "actor/grad_norm": 2.0, "val/acc": None})
    diffs = compare_runs(ref, same, 1e-6, 1e-4)
    assert passed(diffs) and set(diffs) == {"actor/loss", "actor/grad_norm", "val/acc"}
    # timing keys differ between any two runs and are not compared
    other = _rows(**{"actor/loss": 0.5 + 1e-7, "actor/grad_norm": 2.0 * (1 + 5e-5),
                     "val/acc": None})
    other[1]["time/update"] = 9.0
    assert passed(compare_runs(ref, other, 1e-6, 1e-4))
    # beyond atol + rtol |ref|
    bad = _rows(**{"actor/loss": 0.5, "actor/grad_norm": 2.0 * (1 + 2e-4), "val/acc": None})
    d = compare_runs(ref, bad, 1e-6, 1e-4)
    assert not passed(d) and d["actor/grad_norm"].failures and not d["actor/loss"].failures
    # non-finite in one run only, a metric missing, a step missing
    nan = _rows(**{"actor/loss": None, "actor/grad_norm": 2.0, "val/acc": None})
    assert not passed(compare_runs(ref, nan, 1e-6, 1e-4))
    missing = _rows(**{"actor/loss": 0.5, "val/acc": None})
    assert compare_runs(ref, missing, 1e-6, 1e-4)["actor/grad_norm"].failures
    assert not passed(compare_runs(ref, {**same, 2: {"step": 2, "actor/loss": 1.0}}, 1e-6, 1e-4))
    # engine-vs-actor mismatch diagnostics (rounding-level by construction): absolute tolerance
    mref = _rows(**{"rollout/logp_mismatch_max": 2.9e-6})
    assert passed(compare_runs(mref, _rows(**{"rollout/logp_mismatch_max": 7.2e-6}), 1e-6, 1e-4))
    assert not passed(compare_runs(mref, _rows(**{"rollout/logp_mismatch_max": 3e-4}), 1e-6,
                                   1e-4))


@pytest.mark.slow
def test_repro_two_layouts_tiny(tmp_path, capsys):
    out = str(tmp_path / "repro")
    overrides = ["sft.steps=10", "sft.batch_size=16", "trainer.train_batch_size=8",
                 "rollout.gen_batch_size=8", "rollout.n=4", "actor.micro_batch_size=16",
                 "data.train_size=200", "data.val_size=8", "rollout.val_n=1",
                 "trainer.test_freq=100", "trainer.save_freq=100", "trainer.plots=false"]
    rc = main(["repro", os.path.join(ROOT, "examples", "tiny_grpo.yaml"), *overrides,
               "--layouts", "1x1x1,2x1x1", "--steps", "2", "--out", out])
    report = capsys.readouterr().out
    assert rc == 0, report
    assert "repro: PASS" in report and "actor/grad_norm" in report
    assert os.path.exists(os.path.join(out, "repro.png"))
    summary = json.load(open(os.path.join(out, "repro.json")))
    diffs = summary["comparisons"]["2x1x1 vs 1x1x1"]
    assert {"actor/loss", "actor/grad_norm", "policy/entropy", "rollout/reward"} <= set(diffs)
    assert len(read_metrics(os.path.join(out, "2x1x1"))) >= 3  # step 0 (val) + 2 RL steps

    # inject a difference of 1e-3 relative into the TP2 run's grad norm at step 2: it must fail
    path = os.path.join(out, "2x1x1", "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for row in rows:
        if row["step"] == 2:
            row["actor/grad_norm"] *= 1 + 1e-3
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ok, text = compare_dirs({"1x1x1": os.path.join(out, "1x1x1"),
                             "2x1x1": os.path.join(out, "2x1x1")}, 1e-6, 1e-4)
    assert not ok and "FAIL: step 2" in text and "repro: FAIL" in text
    rc = main(["repro", "--layouts", "1x1x1,2x1x1", "--steps", "2", "--out", out,
               "--compare-only"])
    assert rc == 1
