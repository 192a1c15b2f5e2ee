"""Configs that don't lie (issue 11): REINFORCE++ wired with its KL-in-reward term, one temperature
(rollout-vs-actor log-prob mismatch logged), update metrics over all mini-batches and epochs,
Clip-Cov keys per epoch/mini-batch, the entropy controller's state at PP2, checkpoint pruning,
resume preflight (changed config, early-stopped run)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.parallel.launch import spawn
from megatron_rl.rollout.advantages import discounted_returns, masked_whiten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- REINFORCE++ ---------------------------------------------------------------------------------
def _rpp_batch(seed: int, n: int = 6, s: int = 9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, s, dtype=torch.bool)
    for i in range(n - 1):  # the last row is padding (no valid token)
        start = int(torch.randint(1, 4, (1,), generator=g))
        mask[i, start:start + int(torch.randint(1, s - start, (1,), generator=g))] = True
    old = -torch.rand(n, s, generator=g)
    ref = -torch.rand(n, s, generator=g)
    reward = torch.rand(n, generator=g)
    return reward, mask, old, ref


def test_reinforce_pp_token_rewards_and_advantages():
    from megatron_rl.rollout.late_advantages import reinforce_pp, token_rewards

    reward, mask, old, ref = _rpp_batch(0)
    r, kl = token_rewards(reward, mask, old, ref, 0.1)
    for i in range(mask.shape[0]):
        valid = mask[i].nonzero().flatten()
        if valid.numel() == 0:
            assert r[i].abs().sum() == 0
            continue
        last = int(valid[-1])
        want = -0.1 * (old[i] - ref[i]) * mask[i]
        want[last] += reward[i]
        assert torch.allclose(r[i], want, atol=1e-6)
        assert torch.allclose(kl[i], (old[i] - ref[i]) * mask[i], atol=1e-6)
    adv, metrics = reinforce_pp(reward, mask, old, ref, 0.1)
    assert torch.allclose(adv, masked_whiten(discounted_returns(r, mask), mask), atol=1e-6)
    assert metrics["advantage/kl_in_reward"] == pytest.approx(float(kl[mask].mean()), rel=1e-5)
    # the KL term changes the advantages (it is wired, not ignored)
    adv0, _ = reinforce_pp(reward, mask, old, ref, 0.0)
    assert not torch.allclose(adv, adv0)


def test_reinforce_pp_batch_no_longer_crashes():
    """Before: records_to_batch('reinforce_pp') raised at step 1."""
    from megatron_rl.rollout.collect import records_to_batch

    recs = [{"uid": i // 2, "prompt_ids": [1, 2], "response_ids": [3, 4, 5][:1 + i % 3],
             "logprobs": [-0.5] * (1 + i % 3), "reward": float(i % 2), "acc": float(i % 2)}
            for i in range(4)]
    batch = records_to_batch(recs, "reinforce_pp", pad_id=0, rows_multiple=4)
    assert batch["advantages"].shape == batch["mask"].shape
    assert batch["reward"].tolist() == [0.0, 1.0, 0.0, 1.0]


def _whiten_worker(values, mask):
    import torch.distributed as dist

    from megatron_rl.rollout.late_advantages import whiten_across

    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    rows = slice(r * values.shape[0] // w, (r + 1) * values.shape[0] // w)
    out = whiten_across(values[rows], mask[rows])
    dist.destroy_process_group()
    return out


def test_reinforce_pp_whitening_is_dp_invariant():
    """Two DP ranks with half the rows each give the single-process whitening of the batch."""
    reward, mask, old, ref = _rpp_batch(1, n=8)
    values = torch.randn(8, 9)
    parts = spawn(_whiten_worker, 2, (values, mask), timeout_s=120)
    assert torch.allclose(torch.cat(parts), masked_whiten(values, mask), atol=1e-6)


# ---- update metrics ------------------------------------------------------------------------------
def test_update_metrics_aggregate_all_minibatches():
    from megatron_rl.metrics.update import aggregate_updates

    hist = [{"policy/pg_loss": 1.0, "actor/tokens": 10.0, "actor/grad_norm": 2.0,
             "actor/lr": 0.1, "actor/skipped": 0.0, "entropy_dynamics/batch_cov": 4.0},
            {"policy/pg_loss": 4.0, "actor/tokens": 30.0, "actor/grad_norm": 4.0,
             "actor/lr": 0.2, "actor/skipped": 0.0},
            {"policy/pg_loss": float("nan"), "actor/tokens": 50.0, "actor/grad_norm": float("nan"),
             "actor/lr": 0.3, "actor/skipped": 1.0}]
    out = aggregate_updates(hist)
    assert out["policy/pg_loss"] == pytest.approx((1.0 * 10 + 4.0 * 30) / 40)  # skipped left out
    assert out["actor/grad_norm"] == pytest.approx(3.0)
    assert out["actor/lr"] == 0.3 and out["actor/skipped"] == 1.0
    assert out["actor/minibatches"] == 3.0 and out["actor/tokens"] == 90.0
    assert out["entropy_dynamics/batch_cov"] == 4.0  # present in the first epoch's only


def test_update_metric_extremes_are_extremes_of_the_step():
    from megatron_rl.metrics.update import aggregate_updates

    hist = [{"policy/ratio_max": 1.5, "erc/entropy_ratio_min": 0.7, "actor/tokens": 90.0},
            {"policy/ratio_max": 3.0, "erc/entropy_ratio_min": 0.2, "actor/tokens": 10.0}]
    out = aggregate_updates(hist)
    assert out["policy/ratio_max"] == 3.0 and out["erc/entropy_ratio_min"] == 0.2


# ---- Clip-Cov keys -------------------------------------------------------------------------------
def test_clip_cov_keys_change_with_epoch_and_minibatch():
    from megatron_rl.loss import LossConfig, ReductionContext, select_cov_tokens

    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 64, dtype=torch.bool)
    old = -torch.rand(8, 64, generator=g)
    adv = torch.randn(8, 1, generator=g).expand(8, 64).contiguous()
    # a wide covariance window: every unclipped token is a candidate, the random keys decide
    cfg = LossConfig.for_algorithm("clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-1e9,
                                   clip_cov_ub=1e9)
    ctx = ReductionContext.from_minibatch(mask, group=None)

    def pick(salt):
        return select_cov_tokens(ctx, cfg, old, old, adv, mask, step=5, salt=salt).selected[0]

    a, b, c = pick(0), pick(1), pick(65536)
    assert a.sum() == b.sum() == c.sum() > 0
    assert torch.equal(a, pick(0))  # deterministic
    assert not torch.equal(a, b) and not torch.equal(a, c)
    # the micro-batch layout does not change the picks (global sequence indices)
    ctx2 = ReductionContext.from_minibatch([mask[:4], mask[4:]], group=None)
    split = select_cov_tokens(ctx2, cfg, [old[:4], old[4:]], [old[:4], old[4:]],
                              [adv[:4], adv[4:]], [mask[:4], mask[4:]], step=5, salt=1)
    assert torch.equal(torch.cat(split.selected), b)


# ---- Skywork-OR1 controller at PP2 ---------------------------------------------------------------
def _controller_worker(root: str):
    from megatron.core import parallel_state as ps
    from test_actor_layout import make_global_batch

    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.loss import AdaptiveEntropyController, LossConfig
    from megatron_rl.models.config import get_preset
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=1, pp=2, dp=1, timeout_s=120)

    def make():
        ctrl = AdaptiveEntropyController(target=0.5, delta=1e-3)
        return ctrl, Actor(get_preset("tiny"), ActorConfig(), OptimConfig(lr=1e-3),
                           LossConfig.for_algorithm("skywork_or1"), total_steps=2, seed=3,
                           entropy_controller=ctrl)

    ctrl, actor = make()
    batch = make_global_batch(seed=1)
    batch.pop("old_noise")
    actor.update(actor.add_old_logprobs(batch), 0)  # optimizer state exists to be saved
    if ps.is_pipeline_last_stage():  # where the trainer measures entropy and updates it
        for e in (0.1, 0.2, 0.3):
            ctrl.update(e)
    saved = {"coeff": float(ctrl.coeff), "enabled": float(ctrl.enabled)}
    actor.save(root, 0, {"next_step": 1})
    ctrl, actor = make()  # a fresh process's controller, then resume
    actor.resume(root)
    out = {"last": ps.is_pipeline_last_stage(), "saved": saved,
           "resumed": {"coeff": float(ctrl.coeff), "enabled": float(ctrl.enabled)}}
    runtime.shutdown()
    return out


def test_entropy_controller_state_survives_resume_at_pp2(tmp_path):
    outs = spawn(_controller_worker, 2, (str(tmp_path),), timeout_s=300)
    saved = next(o["saved"] for o in outs if o["last"])
    assert saved["coeff"] == pytest.approx(3e-3)  # 3 steps below target on the last stage
    for o in outs:  # every stage, in particular the last one that uses it
        assert o["resumed"] == pytest.approx(saved)


# ---- run directory: pruning, config history, preflight -------------------------------------------
def test_prune_checkpoints_keeps_newest(tmp_path):
    from megatron_rl.run.guard import prune_checkpoints

    for s in range(5):
        (tmp_path / f"step_{s:07d}").mkdir()
    (tmp_path / "step_0000009.tmp").mkdir()
    (tmp_path / "latest").write_text("step_0000004")
    gone = prune_checkpoints(str(tmp_path), 2)
    assert len(gone) == 3
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_0000003", "step_0000004",
                                            "step_0000009.tmp"]
    assert prune_checkpoints(str(tmp_path), 0) == []


def test_config_changes_and_breaking_fields():
    from megatron_rl.config.load import load_config
    from megatron_rl.run.guard import config_changes, is_breaking

    a = load_config(None, []).to_dict()
    b = load_config(None, ["trainer.total_steps=30", "model.preset=tiny", "data.seed=4",
                           "parallel.dp=2", "loss.overrides={clip_ratio_high: 0.3}"]).to_dict()
    ch = config_changes(a, b)
    assert set(ch) == {"trainer.total_steps", "model.preset", "data.seed", "parallel.dp",
                       "loss.overrides.clip_ratio_high"}
    assert {k for k in ch if is_breaking(k)} == {"model.preset", "data.seed"}
    # a run written before a field existed: absent there and at its default now is no change,
    # at another value it is one
    older = json.loads(json.dumps(a))
    del older["model"]["moe_grouped_gemm"], older["trainer"]["total_steps"]
    defaults = type(load_config(None, []))().to_dict()
    assert config_changes(older, a, defaults) == {}
    assert set(config_changes(older, a)) == {"model.moe_grouped_gemm", "trainer.total_steps"}
    assert set(config_changes(older, b, defaults)) == set(ch)


def test_write_config_keeps_the_previous_one(tmp_path):
    from megatron_rl.config.load import load_config
    from megatron_rl.run.guard import write_config

    out = f"output_dir={tmp_path}"
    write_config(load_config(None, [out]))
    write_config(load_config(None, [out]))  # unchanged: nothing kept
    assert not (tmp_path / "config.1.json").exists()
    write_config(load_config(None, [out, "trainer.total_steps=7"]))
    assert json.loads((tmp_path / "config.1.json").read_text())["trainer"]["total_steps"] == 20
    assert json.loads((tmp_path / "config.json").read_text())["trainer"]["total_steps"] == 7


# ---- end to end through the CLI ------------------------------------------------------------------
RUN = ("examples/tiny_grpo.yaml", "parallel.tp=1", "parallel.pp=1", "sft.steps=0",
       "rollout.dynamic_sampling=false", "rollout.gen_batch_size=0", "rollout.n=4",
       "rollout.temperature=0.7",
       "trainer.train_batch_size=8", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
       "actor.ppo_epochs=2", "trainer.advantage=reinforce_pp", "trainer.kl_in_reward_coef=0.01",
       "trainer.plots=false", "trainer.total_steps=4", "trainer.save_freq=1", "trainer.test_freq=1",
       "trainer.keep_checkpoints=2", "data.val_size=8", "rollout.val_n=1",
       "early_stop.val_threshold=1.01", "early_stop.val_patience=3")


def _train(out, *extra):
    return subprocess.run([sys.executable, "-m", "megatron_rl", "train", *RUN,
                           f"output_dir={out}", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _train_here(out, capsys, *extra) -> tuple[int, str, str]:
    """``train`` through the CLI's ``main`` in this process, for command lines the resume
    preflight ends before any rank starts: ``(exit code, stdout, stderr)``."""
    from megatron_rl.cli.app import main

    capsys.readouterr()
    code = main(["train", *RUN, f"output_dir={out}", *extra])
    res = capsys.readouterr()
    return code, res.out, res.err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reinforce_pp_run_metrics_pruning_and_resume_preflight(tmp_path, capsys, monkeypatch):
    """Three steps (early stop), then the resume preflight: a finished run, a refused change
    (both end before any rank starts, so they run in this process) and an allowed one."""
    res = _train(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "early stop at step 3" in res.stdout
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "actor/minibatches" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["actor/minibatches"] == 4.0 and r["actor/skipped"] == 0.0  # 2 epochs x 2
        assert r["advantage/kl_in_reward"] == r["advantage/kl_in_reward"]  # finite (wired)
        # one temperature: the actor's old log-probs match the engine's at T=0.7
        assert r["rollout/logp_mismatch_max"] < 1e-3
        assert 0 <= r["rollout/logp_mismatch_mean"] <= r["rollout/logp_mismatch_max"]
    ckpts = sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("step_"))
    assert ckpts == ["step_0000001", "step_0000002"]  # keep_checkpoints=2

    monkeypatch.chdir(ROOT)
    code, out, _ = _train_here(tmp_path, capsys)  # an early-stopped run is finished
    assert code == 0 and "early-stopped after step 3" in out
    assert len([json.loads(x) for x in open(tmp_path / "metrics.jsonl")]) == len(rows)

    code, _, err = _train_here(tmp_path, capsys, "trainer.advantage=grpo",
                               "trainer.kl_in_reward_coef=0")
    assert code == 2 and err.startswith("error: cannot resume")
    assert "trainer.advantage: 'reinforce_pp' -> 'grpo'" in err

    more = _train(tmp_path, "early_stop.enabled=false")  # allowed change: warned, kept
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "changed config: early_stop.enabled: True -> False" in more.stdout
    assert json.loads((tmp_path / "config.1.json").read_text())["early_stop"]["enabled"] is True
    rows2 = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows2[-1]["step"] == 4
