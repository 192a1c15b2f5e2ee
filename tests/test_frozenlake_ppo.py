"""A tiny multi-turn PPO run (critic + GAE) on FrozenLake improves its success rate (issue 15);
REINFORCE++ with KL in the reward runs on the same episodes. Both runs go one after another in
one spawned rank (one start-up; the CLI path is covered by tests/test_trainer.py)."""

import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "sweeps", "tiny_frozenlake.yaml")


@pytest.fixture(scope="module")
def frozenlake_runs(tmp_path_factory):
    """``name -> (run directory, metrics rows)`` of the PPO run and the REINFORCE++ run."""
    from megatron_rl.parallel.launch import spawn
    from megatron_rl.run.serial_runs import train_each

    root = tmp_path_factory.mktemp("frozenlake")
    jobs = [
        ("ppo", CONFIG, [f"output_dir={root / 'ppo'}", "env.success_rate=1.0",
                         "trainer.total_steps=10", "trainer.plots=false", "trainer.test_freq=10",
                         "trainer.save_freq=100", "env.val_size=8"]),
        ("reinforce_pp", CONFIG, [f"output_dir={root / 'reinforce_pp'}",
                                  "trainer.advantage=reinforce_pp",
                                  "trainer.kl_in_reward_coef=0.01", "trainer.total_steps=2",
                                  "trainer.test_freq=2", "trainer.plots=false",
                                  "trainer.save_freq=100", "env.val_size=4", "sft.steps=5",
                                  "early_stop.enabled=false",
                                  "trainer.collapse_metrics.enabled=true",
                                  "trainer.collapse_metrics.every_n_steps=1",
                                  "trainer.collapse_metrics.max_inputs=4",
                                  "trainer.collapse_metrics.reasoning=reply"]),
    ]
    results = spawn(train_each, 1, (jobs,), timeout_s=850, env={"CUDA_VISIBLE_DEVICES": ""})[0]

    def get(name: str):
        assert "error" not in results[name], results[name]["error"][-3000:]
        out = root / name
        return out, [json.loads(x) for x in open(out / "metrics.jsonl")]

    return get


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_frozenlake_ppo_improves_success(frozenlake_runs):
    out, rows = frozenlake_runs("ppo")
    acc = [r["rollout/success"] for r in rows if "rollout/success" in r]
    assert len(acc) == 10
    first, last = sum(acc[:2]) / 2, sum(acc[-3:]) / 3
    assert last > first + 0.05, acc  # 64 episodes per step (8 maps x 8 rollouts)
    # the critic trained alongside: its loss is reported and finite every step
    assert all(r["critic/skipped"] == 0.0 and r["critic/vf_loss"] >= 0 for r in rows
               if "critic/vf_loss" in r)
    assert (out / "critic_checkpoints" / "latest").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_frozenlake_reinforce_pp_runs_end_to_end_with_collapse_metrics(frozenlake_runs):
    """REINFORCE++ with KL in the reward on multi-turn episodes (issue 23 item 6): the late
    advantages (returns carried across environment tokens) reach the update. The same run logs
    the RAGEN-2 collapse diagnostics (issue 44) on both steps, finite, within their bounds."""
    out, rows = frozenlake_runs("reinforce_pp")
    steps = [r for r in rows if "policy/pg_loss" in r]
    assert len(steps) == 2 and not (out / "critic_checkpoints").exists()
    # step 2 trains on updated weights, so old and reference policies differ: KL in the reward
    assert steps[1]["advantage/kl_in_reward"] > 0
    assert all(abs(r["policy/pg_loss"]) < 1e3 for r in steps)
    for r in steps:  # 4 inputs (env maps) x 8 samples each, every reply scored under every map
        assert r["collapse/inputs"] == 4 and r["collapse/samples"] == 32, r
        keys = [k for k in r if k.startswith("collapse/")]
        assert all(math.isfinite(r[k]) for k in keys), {k: r[k] for k in keys}
        assert r["collapse/conditional_entropy"] >= 0 and r["collapse/valid_rate"] > 0
        assert r["collapse/mi_estimate"] <= r["collapse/mi_upper_bound"] + 1e-9
        assert 0 <= r["collapse/retrieval_accuracy"] <= 1
