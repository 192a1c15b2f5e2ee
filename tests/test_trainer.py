"""The RL loop end to end through the CLI: every example recipe runs; a short run improves its
training reward (its two ranks run the CLI in place, as under torchrun); a PP2 x DP2 run
(``python -m megatron_rl train``, launcher and all) streams weights from one DP replica. (A
run killed mid-way resumes to the uninterrupted run's metrics and checkpoint:
tests/test_lifecycle.py, through tools/chaos.py.)"""

import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOLATILE = ("time", "wall_s")


def train_cmd(config: str, out, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl", "train", config, f"output_dir={out}",
            *overrides]


def run_train(config: str, out, *overrides: str, timeout: int = 600) -> str:
    res = subprocess.run(train_cmd(config, out, *overrides), cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def train_in_ranks(world: int, config: str, out, *overrides: str) -> str:
    """``train config output_dir=out overrides`` run in place on ``world`` spawned ranks (as
    under torchrun; :func:`conftest.run_cli`): rank 0's stdout. For runs that are not about
    the launcher: no interpreter start-up, the ranks fork from the test's rank server."""
    from conftest import run_cli

    (code, stdout, stderr), = run_cli(world, train_cmd(config, out, *overrides)[3:])
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items()
             if k not in VOLATILE and not k.startswith(("time/", "sys/"))}  # sys/: RSS, fds
            for r in rows]


# The main recipe at TP2xPP1, 30 steps (about 40 s on 2 cores). One checkpoint, at the end: a
# save costs more than a tiny step and does not change the run (resumes elsewhere are bit-exact).
SHORT = ("parallel.tp=2", "parallel.pp=1", "trainer.total_steps=30", "trainer.test_freq=10",
         "trainer.plots=false",
         "trainer.save_freq=30", "data.val_size=16")


RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "tiny_*.yaml")))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_example_recipe_runs(tmp_path):
    """Two RL steps of every tiny recipe, one after another in one spawned rank (one start-up
    for all; the CLI path itself is covered by the runs below). Plots are drawn for one. The
    recipes that differ from tiny_dapo.yaml only in their loss (test_recipes_active's
    ACTIVE_METRICS) take their two steps in that file's shared short runs, which check the same
    (two steps, nothing skipped, the loss and the entropy diagnostic logged); the others here,
    each with its own supervised warm start and validation."""
    from conftest import make_preset_hf
    from test_recipes_active import ACTIVE_METRICS

    from megatron_rl.parallel.launch import spawn
    from megatron_rl.run.serial_runs import train_each

    names = {os.path.basename(c)[:-len(".yaml")] for c in RECIPES}
    assert set(ACTIVE_METRICS) < names  # run there, each still a shipped recipe
    here = [c for c in RECIPES if os.path.basename(c)[:-len(".yaml")] not in ACTIVE_METRICS]
    # tiny_opd.yaml distils the main job's model: a random model of its architecture here (and
    # the main job's batch, not the demo's eight-times larger one)
    teacher = [f"teacher.hf_path={make_preset_hf(str(tmp_path / 'teacher'))}",
               "trainer.train_batch_size=16", "rollout.gen_batch_size=16",
               "actor.mini_batch_size=32"]
    jobs = [(os.path.basename(c), c,
             [f"output_dir={tmp_path / os.path.basename(c)}", "parallel.tp=1", "parallel.pp=1",
              "sft.steps=3", "trainer.total_steps=2", "trainer.test_freq=2",
              "rollout.dynamic_sampling=false", "data.val_size=16",
              f"trainer.plots={str(i == 0).lower()}",
              *(teacher if "teacher" in yaml.safe_load(open(c)) else [])])
            for i, c in enumerate(here)]
    results = spawn(train_each, 1, (jobs,), timeout_s=850, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    failed = {name: r["error"][-2000:] for name, r in results.items() if "error" in r}
    assert not failed, failed
    assert sorted(results) == sorted(os.path.basename(c) for c in here)
    for name in results:
        assert results[name]["summary"]["steps"] == 2, name
        last = metrics(tmp_path / name)[-1]
        assert last["actor/skipped"] == 0.0 and "policy/pg_loss" in last, name
        assert "entropy_dynamics/cov_mean_top" in last, name
    first = os.path.basename(here[0])
    assert (tmp_path / first / "plots" / "accuracy.png").stat().st_size > 0
    assert not (tmp_path / os.path.basename(here[1]) / "plots").exists()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    stdout = train_in_ranks(2, os.path.join(ROOT, "examples", "tiny_dapo.yaml"), out, *SHORT)
    return out, stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_run_improves_training_reward(reference_run):
    out, stdout = reference_run
    rows = [r for r in metrics(out) if "rollout/acc" in r]
    assert len(rows) == 30
    first = sum(r["rollout/acc"] for r in rows[:5]) / 5
    last = sum(r["rollout/acc"] for r in rows[-5:]) / 5
    assert last > first + 0.05, (first, last)
    assert "summary: val_acc_start=" in stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_data_parallel_pipeline_run(tmp_path):
    """PP2 x DP2: only DP replica 0 streams weights to the engine; the others must not hang."""
    out = run_train("examples/tiny_dapo.yaml", tmp_path, "parallel.tp=1", "parallel.pp=2",
                    "parallel.dp=2", "sft.steps=3", "trainer.total_steps=2",
                    "trainer.test_freq=2", "rollout.dynamic_sampling=false", "trainer.plots=false")
    assert "summary: val_acc_start=" in out
    assert metrics(tmp_path)[-1]["actor/skipped"] == 0.0
