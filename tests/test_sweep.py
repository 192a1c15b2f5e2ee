"""The sweep runner (issue 15): sweep files expand to validated runs; the report summarises each
run (best/final validation success, steps, early stop and why); a 2-condition tiny sweep writes
the report and plots and, killed mid-way, resumes without re-running its finished condition."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.cli.sweep import load_sweep, summarize
from megatron_rl.config.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "sweeps", "tiny_frozenlake.yaml")


def write_sweep(tmp_path, body: str) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {BASE}\noutput_dir: {tmp_path / 'out'}\n" + body)
    return str(path)


def test_sweep_file_expands_and_validates(tmp_path):
    path = write_sweep(tmp_path, "sweeps:\n  - name: ent\n    axis: loss.overrides.entropy_coeff\n"
                       "    values: [0, 0.01]\n    conditions:\n"
                       "      nokl: {loss.overrides.use_kl_loss: false}\n")
    plan = load_sweep(path)
    assert [c.name for c in plan.conditions] == ["entropy_coeff=0", "entropy_coeff=0.01", "nokl"]
    assert plan.conditions[1].overrides == {"loss.overrides.entropy_coeff": 0.01}
    assert plan.conditions[1].run_dir == str(tmp_path / "out" / "ent" / "entropy_coeff=0.01")
    bad = write_sweep(tmp_path, "sweeps:\n  - name: x\n    values: [1]\n")
    with pytest.raises(ConfigError, match="'values' but no 'axis'"):
        load_sweep(bad)
    bad = write_sweep(tmp_path, "sweeps:\n  - name: x\n    conditions:\n"
                      "      a: {rollout.rv_filter_p: 1.5}\n")
    with pytest.raises(ConfigError, match="condition a: .*rv_filter_p"):
        load_sweep(bad)


def test_summarize_best_final_and_early_stop_reason():
    rows = [{"step": 0, "val/acc": 0.1},
            {"step": 1, "val/acc": 0.5, "early_stopped/validation_collapse": 0.0},
            {"step": 2},
            {"step": 3, "val/acc": 0.25, "early_stopped/reward_variance_collapse": 1.0}]
    s = summarize(rows)
    assert (s["best_val"], s["final_val"], s["steps"], s["early_stopped"]) == (0.5, 0.25, 3, True)
    assert s["reason"] == "reward-variance collapse"
    assert summarize([{"step": 4, "val/acc": 0.0}])["early_stopped"] is False


TINY = ("overrides: {trainer.total_steps: 2, trainer.test_freq: 1, trainer.save_freq: 1,\n"
        "  trainer.plots: false,\n"
        "  sft.steps: 2, env.size: 3, env.max_turns: 2, env.val_size: 4, rollout.n: 4,\n"
        "  trainer.train_batch_size: 2, actor.micro_batch_size: 8, actor.mini_batch_size: 8}\n"
        "sweeps:\n  - name: rv\n    axis: rollout.rv_filter_p\n    conditions:\n"
        "      a: {rollout.rv_filter_p: 1.0}\n"
        "      b: {rollout.rv_filter_p: 0.9, rollout.rv_include_zero: false,\n"
        "          loss.overrides.use_kl_loss: true, loss.overrides.kl_loss_coef: 0.01}\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_sweep_report_plots_and_resume_after_kill(tmp_path):
    path = write_sweep(tmp_path, TINY)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megatron_rl", "sweep", path]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    done_a = out / "rv" / "a" / "sweep_done.json"
    t0 = time.time()
    while not done_a.exists() and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.5)
    assert done_a.exists(), proc.stdout.read().decode()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and run b die mid-way
    proc.wait()
    assert not (out / "rv" / "b" / "sweep_done.json").exists()
    log_a = (out / "rv" / "a" / "train.log").read_text()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "skip finished run rv/a" in res.stdout and "start rv/b" in res.stdout
    assert "start rv/a" not in res.stdout
    assert (out / "rv" / "a" / "train.log").read_text() == log_a  # not run again
    report = (out / "report.md").read_text()
    for cond in ("a", "b"):
        line = next(x for x in report.splitlines() if x.startswith(f"| {cond} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows = [json.loads(x) for x in open(out / "rv" / cond / "metrics.jsonl")]
        vals = [r["val/acc"] for r in rows if r.get("val/acc") is not None]
        assert cells[1] == f"{max(vals):.3f}" and cells[2] == f"{vals[-1]:.3f}"
        assert cells[3] == "2" and cells[5] == "yes"
    plots = sorted(os.listdir(out / "plots"))
    assert plots == ["rv_entropy.png", "rv_kl_to_ref.png", "rv_reward_std.png",
                     "rv_val_success.png"]
    assert all((out / "plots" / p).stat().st_size > 1000 for p in plots)
