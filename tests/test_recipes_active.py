"""Recipes whose methods act: which losses are inert at ``pi/pi_old = 1`` (checked against the
losses' own gradients), the load-time warning for one on-policy update per step, and short runs
of each ratio-based tiny recipe whose mechanism shows in its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.config.checks import ratio_one_warning
from megatron_rl.config.load import load_config
from megatron_rl.loss import (
    LossConfig,
    LossInputs,
    ReductionContext,
    compute_loss,
    get_policy_loss,
    policy_loss_names,
    select_cov_tokens,
)
from megatron_rl.loss.bapo import bapo_bounds
from megatron_rl.loss.ratio_one import (
    RATIO_ONE,
    acting_at_ratio_one,
    inert_at_ratio_one,
    updates_per_step,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the table against the losses' gradients ---------------------------------------------------
def test_active_table_covers_every_policy_loss():
    assert set(RATIO_ONE) == set(policy_loss_names())


def _on_policy_grad(name: str, erc: bool = False, cov_frac: float = 0.25) -> torch.Tensor:
    """d loss / d logp at logp = old_logp for policy loss ``name`` (4 x 6 tokens, padding in the
    last row, mixed-sign advantages), everything else at its default."""
    torch.manual_seed(0)
    b, t = 4, 6
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[3, 4:] = False
    logp = -torch.rand(b, t) * 3
    adv = torch.randn(b, 1).expand(b, t).contiguous()
    ent = torch.rand(b, t) + 0.1
    agg = get_policy_loss(name).forced_agg or "token-mean"
    cfg = LossConfig(policy_loss=name, erc=erc, loss_agg_mode=agg, clip_cov_ratio=cov_frac,
                     kl_cov_ratio=cov_frac, clip_cov_lb=-1e9, clip_cov_ub=1e9).validate()
    ctx = ReductionContext.from_minibatch(mask, group=None)
    sel = None
    if name in ("clip_cov", "kl_cov"):
        sel = select_cov_tokens(ctx, cfg, logp, logp, adv, mask).selected[0]
    bounds = None
    if name == "bapo":
        bounds = bapo_bounds(ctx, cfg, logp, logp, adv, mask).bounds
    x = logp.clone().requires_grad_(True)
    inp = LossInputs(x, logp, adv, mask, entropy=ent, old_entropy=ent, cov_selected=sel,
                     bapo_bounds=bounds)
    compute_loss(inp, cfg, ctx).loss.backward()
    return x.grad


@pytest.mark.parametrize("name", sorted(set(policy_loss_names()) - {"nll"}))
def test_active_table_matches_gradient_at_ratio_one(name):
    """A loss the table calls inert gives exactly the policy gradient of its aggregation at r = 1;
    one it calls acting does not."""
    agg = get_policy_loss(name).forced_agg or "token-mean"
    plain = _on_policy_grad("ppo") if agg == "token-mean" else None
    if plain is None:  # the policy gradient under the loss's own aggregation
        torch.manual_seed(0)
        plain = _plain_pg_grad(agg)
    grad = _on_policy_grad(name)
    if RATIO_ONE[name].acts:
        assert not torch.allclose(grad, plain, atol=1e-7), name
    else:
        torch.testing.assert_close(grad, plain, atol=1e-7, rtol=1e-6)


def _plain_pg_grad(agg: str) -> torch.Tensor:
    """The gradient of ``-A logp`` aggregated with ``agg`` (same inputs as _on_policy_grad)."""
    b, t = 4, 6
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[3, 4:] = False
    logp = -torch.rand(b, t) * 3
    adv = torch.randn(b, 1).expand(b, t)
    x = logp.clone().requires_grad_(True)
    per_seq = ((-adv * x) * mask).sum(1) / mask.sum(1)
    assert agg == "seq-mean-token-mean"
    per_seq.mean().backward()
    return x.grad


def test_active_ppo_is_the_plain_policy_gradient_at_ratio_one():
    torch.manual_seed(0)
    b, t = 4, 6
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[3, 4:] = False
    _ = -torch.rand(b, t) * 3
    adv = torch.randn(b, 1).expand(b, t)
    torch.testing.assert_close(_on_policy_grad("ppo"), -adv * mask / mask.sum())


def test_active_erc_gate_is_inert_at_ratio_one():
    torch.testing.assert_close(_on_policy_grad("ppo", erc=True), _on_policy_grad("ppo"))
    assert "ERC" in " ".join(inert_at_ratio_one(LossConfig(policy_loss="ppo", erc=True)))


def test_active_lists_what_acts_anyway():
    cfg = LossConfig.for_algorithm("aspo")  # KL to the reference in its preset
    assert inert_at_ratio_one(cfg) and "use_kl_loss" in " ".join(acting_at_ratio_one(cfg))
    assert inert_at_ratio_one(LossConfig.for_algorithm("clip_cov")) == []
    assert updates_per_step(128, 0, 1) == 1 and updates_per_step(128, 32, 1) == 4
    assert updates_per_step(128, 128, 2) == 2


def test_active_siren_regulariser_acts_at_ratio_one():
    """SIREN's term is listed as acting at r = 1, and it does: a gradient on the selected
    tokens' entropies while the clip is inert."""
    from megatron_rl.loss.siren import SirenTerm, siren_select

    cfg = LossConfig.for_algorithm("siren")
    assert "SIREN" in " ".join(acting_at_ratio_one(cfg))
    mask = torch.ones(2, 5, dtype=torch.bool)
    ent = torch.arange(10.0).view(2, 5).requires_grad_(True)
    ctx = ReductionContext.from_minibatch(mask, group=None)
    sel = siren_select(ctx, cfg, ent, mask)
    logp = torch.zeros(2, 5)
    inp = LossInputs(logp.clone().requires_grad_(True), logp, torch.ones(2, 5), mask,
                     entropy=ent, siren=SirenTerm(sel.selected[0], sel.h_sel - 1.0, sel.n_sel))
    compute_loss(inp, cfg, ctx).loss.backward()
    assert (ent.grad[sel.selected[0]] > 0).all() and (ent.grad[~sel.selected[0]] == 0).all()


# ---- the load-time warning ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides,warns", [
    (["actor.mini_batch_size=0", "actor.micro_batch_size=64"], True),
    (["actor.mini_batch_size=128", "actor.micro_batch_size=64"], True),
    (["actor.mini_batch_size=0", "actor.micro_batch_size=64", "actor.ppo_epochs=2"], False),
    ([], False),  # the recipe: four mini-batches
    (["actor.mini_batch_size=0", "actor.micro_batch_size=64", "loss.algorithm=clip_cov"], False),
    (["actor.mini_batch_size=0", "actor.micro_batch_size=64", "loss.algorithm=kl_cov"], True),
    (["actor.mini_batch_size=0", "actor.micro_batch_size=64", "loss.algorithm=dapo_erc"], True),
])
def test_active_warning_for_one_on_policy_update(overrides, warns, tmp_path):
    cfg = load_config("examples/tiny_dapo.yaml", [f"output_dir={tmp_path}", *overrides])
    msg = ratio_one_warning(cfg)
    assert (msg is not None) == warns, msg
    if warns:
        assert "\n" not in msg
        for field in ("actor.mini_batch_size", "actor.ppo_epochs", "loss.algorithm"):
            assert field in msg


def test_active_warning_printed_once_at_load(tmp_path):
    code = ("from megatron_rl.config.load import load_config\n"
            "for _ in range(2):\n"
            f"    load_config('examples/tiny_grpo.yaml', ['output_dir={tmp_path}', "
            "'actor.mini_batch_size=0', 'actor.micro_batch_size=64'])\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(lines) == 1 and "loss.algorithm=grpo" in lines[0], res.stderr


@pytest.mark.parametrize("recipe", ["tiny_dapo", "tiny_dapo_erc", "tiny_aspo", "tiny_gppo",
                                    "tiny_grpo", "tiny_kl_cov", "tiny_clip_cov", "tiny_dppo",
                                    "tiny_gmpo", "tiny_sapo", "tiny_bapo",
                                    "tiny_siren"])
def test_active_recipes_take_several_updates_per_step(recipe, tmp_path):
    cfg = load_config(f"examples/{recipe}.yaml", [f"output_dir={tmp_path}"])
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    assert updates_per_step(rows, cfg.actor.mini_batch_size, cfg.actor.ppo_epochs) > 1
    assert ratio_one_warning(cfg) is None


# ---- short runs: each mechanism shows in the metrics --------------------------------------------
# recipe -> the metrics that must be > 0 when its mechanism acts (means over the step's updates)
ACTIVE_METRICS = {
    "tiny_dapo": ("policy/clip_frac",),
    "tiny_grpo": ("policy/clip_frac",),
    "tiny_gppo": ("policy/clip_frac",),
    "tiny_dapo_erc": ("erc_gated",),  # 1 - erc/kept_frac
    "tiny_aspo": ("aspo_clipped",),  # aspo/clip_frac_upper + aspo/clip_frac_lower
    "tiny_kl_cov": ("kl_cov/penalised_frac", "policy/abs_log_ratio"),
    "tiny_clip_cov": ("clip_cov/zeroed_frac",),
    "tiny_bapo": ("policy/clip_frac", "bapo/clip_high"),
    "tiny_siren": ("siren/reg", "siren/selected_frac"),
}
SHORT = ("parallel.tp=1", "parallel.pp=1", "sft.steps=0", "trainer.total_steps=2",
         "trainer.test_freq=100", "trainer.save_freq=100", "trainer.plots=false",
         "data.val_size=4", "rollout.val_n=1")


@pytest.fixture(scope="module")
def warm_weights(tmp_path_factory) -> str:
    """One supervised warm start of the tiny recipes (TP1), shared by the short runs (the CLI
    in place on one spawned rank, as under torchrun: conftest.run_cli)."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("sft")
    (code, stdout, stderr), = run_cli(1, ["sft", os.path.join(ROOT, "examples", "tiny_dapo.yaml"),
                                          f"output_dir={out}", "parallel.tp=1", "parallel.pp=1"])
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    path = os.path.join(out, "sft_weights.pt")
    assert os.path.exists(path)
    return path


@pytest.fixture(scope="module")
def short_runs(warm_weights, tmp_path_factory):
    """``recipe -> (summary, metrics rows)`` of its short run from the shared warm start: every
    recipe of :data:`ACTIVE_METRICS` once, one after another in one spawned rank (one
    start-up). These runs are also these recipes' share of test_trainer's every-recipe check."""
    from megatron_rl.parallel.launch import spawn
    from megatron_rl.run.serial_runs import train_each

    root = tmp_path_factory.mktemp("short")
    jobs = [(r, os.path.join(ROOT, "examples", f"{r}.yaml"),
             [f"output_dir={root / r}", f"model.init_weights={warm_weights}", *SHORT])
            for r in sorted(ACTIVE_METRICS)]
    results = spawn(train_each, 1, (jobs,), timeout_s=900, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    failed = {name: res["error"][-2000:] for name, res in results.items() if "error" in res}
    assert not failed, failed

    def get(recipe: str) -> tuple[dict, list[dict]]:
        rows = [json.loads(line) for line in open(root / recipe / "metrics.jsonl")]
        return results[recipe]["summary"], rows

    return get


def _derived(row: dict) -> dict:
    out = dict(row)
    if "erc/kept_frac" in row:
        out["erc_gated"] = 1.0 - row["erc/kept_frac"]
    if "aspo/clip_frac_upper" in row:
        out["aspo_clipped"] = row["aspo/clip_frac_upper"] + row["aspo/clip_frac_lower"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(ACTIVE_METRICS))
def test_active_mechanism_acts_in_recipe(recipe, short_runs):
    """The recipe runs its two RL steps (nothing skipped, the policy loss and the entropy
    dynamics diagnostic logged) and its mechanism shows in each step's metrics."""
    summary, raw = short_runs(recipe)
    assert summary["steps"] == 2
    rows = [_derived(r) for r in raw]
    steps = [r for r in rows if "policy/ppo_kl" in r]
    assert len(steps) == 2
    assert steps[-1]["actor/skipped"] == 0.0 and "policy/pg_loss" in steps[-1]
    assert "entropy_dynamics/cov_mean_top" in steps[-1]
    for r in steps:
        assert r["policy/ppo_kl"] != 0.0  # updates 2-4 are off-policy
        for key in ACTIVE_METRICS[recipe]:
            assert r[key] > 0.0, (recipe, key, r[key])


@pytest.mark.slow
def test_active_kl_cov_differs_from_dapo(short_runs):
    """With one update per step the two recipes logged identical metrics at every step; now the
    KL-Cov penalty acts from the second update on, so the first step's update differs."""
    dapo = [r for r in short_runs("tiny_dapo")[1] if "policy/ppo_kl" in r]
    klcov = [r for r in short_runs("tiny_kl_cov")[1] if "policy/ppo_kl" in r]
    assert dapo[0]["rollout/reward"] == klcov[0]["rollout/reward"]  # the same first rollout
    assert dapo[0]["actor/grad_norm"] != klcov[0]["actor/grad_norm"]
    assert dapo[-1]["policy/entropy"] != klcov[-1]["policy/entropy"]


def test_active_docs_table_agrees_with_the_module():
    """docs/algorithms-and-losses.md names every policy loss in its ratio-1 table, with the
    module's verdict."""
    text = open(os.path.join(ROOT, "docs", "algorithms-and-losses.md")).read()
    section = text.split("## On-policy updates (ratio = 1)")[1].split("\n## ")[0]
    verdict = {}
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 3:
            for name in cells[0].split("(")[0].replace("|", "").split(","):
                verdict[name.strip().strip("`")] = "acts" in cells[1]
    for name in set(policy_loss_names()) - {"nll"}:
        assert verdict.get(name) == RATIO_ONE[name].acts, name
