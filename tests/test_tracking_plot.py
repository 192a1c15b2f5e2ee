"""Tracker writes JSONL (and resumes), the progress line, gpu_stats, and plot_run writes PNGs."""

import io
import json
import os

import pytest

from megatron_rl.metrics.tracking import Tracker, gpu_stats


def _log_run(run_dir, steps, resume_step=None):
    buf = io.StringIO()
    tr = Tracker(str(run_dir), total_steps=10, use_tensorboard=False, use_wandb=True,
                 resume_step=resume_step, stream=buf)
    for s in steps:
        m = {"train/reward_mean": 0.1 * s, "train/acc": 0.05 * s, "actor/entropy": 2.0 - 0.1 * s,
             "actor/pg_clipfrac": 0.01 * s, "actor/erc_kept_frac": 0.9,
             "actor/cov_mean": 0.001 * s, "time/step_s": 1.0, "note": "x", "bad": float("nan")}
        if s % 2 == 0:
            m["val/acc"] = 0.1 * s
        tr.log(m, s)
    tr.close()
    return buf.getvalue()


def test_tracker_jsonl_progress_and_resume(tmp_path):
    out = _log_run(tmp_path, range(1, 5))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["train/reward_mean"] == pytest.approx(0.1) and rows[0]["bad"] is None
    lines = out.strip().splitlines()
    assert any("[step 4/10]" in ln and "reward 0.400" in ln and "ETA" in ln and "val_acc 0.400"
               in ln for ln in lines)
    assert "\r" not in out
    # resume from step 2: steps 3, 4 are dropped and re-logged
    _log_run(tmp_path, [3], resume_step=2)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_tensorboard_optional(tmp_path):
    buf = io.StringIO()
    tr = Tracker(str(tmp_path), use_tensorboard=True, stream=buf, progress=False)
    tr.log({"a/b": 1.0}, 1)
    tr.close()
    assert (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "tensorboard").exists() or "TensorBoard disabled" in buf.getvalue()


def test_gpu_stats_is_dict():
    assert isinstance(gpu_stats(), dict)


def test_plot_run(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_rl.metrics.plot import plot_run

    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_run(str(tmp_path))
    _log_run(tmp_path, range(1, 7))
    paths = plot_run(str(tmp_path))
    names = {os.path.basename(p) for p in paths}
    for n in ["reward.png", "accuracy.png", "entropy.png", "clip_fraction.png", "erc.png",
              "covariance.png", "timing.png", "prefix_train.png", "prefix_val.png",
              "prefix_actor.png"]:
        assert n in names
    assert "early_stopping.png" not in names  # no such keys: skipped
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 1000
