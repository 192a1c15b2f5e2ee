"""``optim.use_distributed_optimizer`` without apex / Transformer Engine (torch-Adam fallback).

One spawned 2-rank job runs every case (process groups reused across layouts):

- TP1xDP2, fp32 and bf16: the distributed optimizer trains like the standard one; a run resumed
  from its step-0 checkpoint equals the uninterrupted run bit for bit (weights, fp32 main weights,
  Adam moments, per-parameter step counts, every metric);
- the same resume with each :mod:`megatron_rl.actor.distopt_compat` patch left out fails or
  differs (so each patch is needed; the shared-``step`` bug shows as a silently wrong resume);
- TP2xDP1 and TP1xPP2 load that DP2 checkpoint: the same main weights and moments, then the same
  next steps as the uninterrupted run and as the standard optimizer resumed the same way; a
  bf16 actor loads the fp32 checkpoint (and vice versa) with the exact fp32 main weights.

And the CLI end to end: a DP2 run with the distributed optimizer, resumed from its first
checkpoint, logs the same metrics as the uninterrupted run.
"""

import os

import pytest
import torch
from test_actor_checkpoint import _train
from test_actor_layout import GLOBAL_SEQS, loss_config
from test_trainer import ROOT, metrics, train_in_ranks

from megatron_rl.parallel.launch import spawn

STEPS = 3  # step 0 is saved; steps 1 and 2 run after the resume


def _actor(dp: int, dist_opt: bool, precision: str):
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset

    return Actor(get_preset("tiny"),
                 ActorConfig(micro_batch_size=GLOBAL_SEQS // dp // 2, precision=precision),
                 OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, weight_decay=0.1,
                             use_distributed_optimizer=dist_opt),
                 loss_config(), total_steps=STEPS, seed=7)


def _inner_states(optimizer) -> dict:
    """The torch optimizers' per-parameter states (keyed by main param)."""
    states = {}
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        states.update(o.optimizer.state)
    return states


def _moments(actor, key: str) -> dict[str, torch.Tensor]:
    """Canonical full ``key`` (``exp_avg``/``exp_avg_sq``) tensors by parameter name."""
    from megatron_rl.actor.precision import (
        bare_model,
        distributed_optimizers,
        gather_distopt_state,
        main_param_map,
    )
    from megatron_rl.models.weights import gather_full_state_dict

    if distributed_optimizers(actor.optimizer):
        by_id = gather_distopt_state(actor.optimizer, key, half_only=False)
    else:
        mains, states = main_param_map(actor.optimizer), _inner_states(actor.optimizer)
        by_id = {id(p): states[mains.get(id(p), p)][key]
                 for p in bare_model(actor.model).parameters()}
    return gather_full_state_dict(bare_model(actor.model), main=by_id)


def _snapshot(actor, history: list | None = None) -> dict:
    from megatron_rl.actor.precision import gather_main_state_dict
    from megatron_rl.models.weights import gather_full_state_dict

    states = list(_inner_states(actor.optimizer).values())
    return {"weights": gather_full_state_dict(actor.model),
            "main": gather_main_state_dict(actor.model, actor.optimizer),
            "exp_avg": _moments(actor, "exp_avg"), "exp_avg_sq": _moments(actor, "exp_avg_sq"),
            "steps": sorted({float(s["step"]) for s in states}),
            "shared_steps": len(states) - len({id(s["step"]) for s in states}),
            "history": history}


def _max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over the tensors of two snapshots (inf on a key mismatch)."""
    worst = 0.0
    for part in ("weights", "main", "exp_avg", "exp_avg_sq"):
        if a[part].keys() != b[part].keys():
            return float("inf")
        for k in a[part]:
            worst = max(worst, float((a[part][k].float() - b[part][k].float()).abs().max()))
    return worst


def _metric_diff(h1: list, h2: list) -> float:
    assert len(h1) == len(h2) and all(r1.keys() == r2.keys() for r1, r2 in zip(h1, h2))
    return max(abs(r1[k] - r2[k]) for r1, r2 in zip(h1, h2) for k in r1)


def _resume_and_train(dp: int, dist_opt: bool, precision: str, root: str) -> tuple[dict, dict]:
    """(state right after loading ``root``, state after steps 1..STEPS-1)."""
    actor = _actor(dp, dist_opt, precision)
    actor.resume(root)
    loaded = _snapshot(actor)
    history = _train(actor, dp, 1, STEPS, None, None)
    return loaded, _snapshot(actor, history)


def _distopt_worker(root: str) -> dict:
    from megatron_rl.actor import distopt_compat
    from megatron_rl.actor.precision import gather_main_state_dict
    from megatron_rl.parallel import runtime

    out: dict = {}
    runtime.init_parallel(tp=1, pp=1, dp=2, timeout_s=120)
    ref: dict = {}
    for prec in ("fp32", "bf16"):
        for dist_opt in (False, True):
            actor = _actor(2, dist_opt, prec)
            path = os.path.join(root, f"{prec}-{'dist' if dist_opt else 'std'}")
            history = _train(actor, 2, 0, 1, path, None)  # saved after step 0
            saved = _snapshot(actor)
            history += _train(actor, 2, 1, STEPS, None, None)
            ref[prec, dist_opt] = saved, _snapshot(actor, history)
        (_, std), (saved, full) = ref[prec, False], ref[prec, True]
        out[f"{prec} dist vs std"] = (_max_diff(full, std),
                                      _metric_diff(full["history"], std["history"]))
        loaded, resumed = _resume_and_train(2, True, prec, os.path.join(root, f"{prec}-dist"))
        out[f"{prec} resume"] = {"loaded": _max_diff(loaded, saved), "final": _max_diff(
            resumed, full), "history": resumed["history"] == full["history"][1:],
            "steps": resumed["steps"], "shared_steps": resumed["shared_steps"]}
    # Each patch left out in turn: the fp32 resume fails or silently differs.
    for name in distopt_compat.PATCHES:
        distopt_compat.uninstall()
        distopt_compat.install(exclude=(name,))
        try:
            _, resumed = _resume_and_train(2, True, "fp32", os.path.join(root, "fp32-dist"))
            out[f"without {name}"] = ("differs by", _max_diff(resumed, ref["fp32", True][1]),
                                      resumed["steps"])
        except Exception as e:  # noqa: BLE001 - the failure is the expected outcome
            out[f"without {name}"] = (f"{type(e).__name__}: {e}"[:200],)
        torch.distributed.barrier()
    distopt_compat.uninstall()
    distopt_compat.install()
    out["active"] = distopt_compat.active()
    # The DP2 checkpoints at other layouts (DP1 with TP2, DP1 with PP2).
    for tp, pp, precs in ((2, 1, ("fp32", "bf16")), (1, 2, ("fp32",))):
        runtime.init_parallel(tp=tp, pp=pp, dp=1, timeout_s=120)
        for prec in precs:
            res = {}
            for dist_opt in (True, False):
                path = os.path.join(root, f"{prec}-{'dist' if dist_opt else 'std'}")
                res[dist_opt] = _resume_and_train(1, dist_opt, prec, path)
            saved, full = ref[prec, True]
            (loaded, resumed), (_, std) = res[True], res[False]
            out[f"{prec} tp{tp}pp{pp}"] = {
                "loaded": _max_diff(loaded, saved), "final vs DP2": _max_diff(resumed, full),
                "final vs std": _max_diff(resumed, std),
                "metrics vs std": _metric_diff(resumed["history"], std["history"])}
        if (tp, pp) == (2, 1):  # across precisions too: the fp32 main weights are restored
            for saved_prec, prec in (("fp32", "bf16"), ("bf16", "fp32")):
                actor = _actor(1, True, prec)
                actor.resume(os.path.join(root, f"{saved_prec}-dist"))
                want = ref[saved_prec, True][0]["main"]
                got = gather_main_state_dict(actor.model, actor.optimizer)
                out[f"{saved_prec}->{prec}"] = max(float((got[k] - want[k]).abs().max())
                                                   for k in want)
    rank = torch.distributed.get_rank()
    runtime.shutdown()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distopt")
    out = spawn(_distopt_worker, 2, (str(root),), timeout_s=400)[0]
    print(out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_distributed_optimizer_trains_like_the_standard_one(report):
    weights, metrics = report["fp32 dist vs std"]
    assert weights <= 1e-6 and metrics <= 1e-6, report["fp32 dist vs std"]
    weights, metrics = report["bf16 dist vs std"]
    assert weights <= 1e-6 and metrics <= 1e-6, report["bf16 dist vs std"]


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_identical_with_per_parameter_steps(report, precision):
    r = report[f"{precision} resume"]
    assert r["loaded"] == 0.0 and r["final"] == 0.0 and r["history"], r
    assert r["steps"] == [float(STEPS)] and r["shared_steps"] == 0, r


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_each_compat_patch_is_needed(report):
    from megatron_rl.actor import distopt_compat

    assert report["active"] == tuple(distopt_compat.PATCHES)
    assert "AssertionError" in report["without fresh_state_dict"][0]
    assert "KeyError: 'step'" in report["without keep_step_on_load"][0]
    # The shared step: no error, a wrong resume (every step adds one per parameter).
    what, diff, steps = report["without per_param_step"]
    assert diff > 1e-3 and steps != [float(STEPS)], report["without per_param_step"]


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["fp32 tp2pp1", "bf16 tp2pp1", "fp32 tp1pp2"])
def test_checkpoint_loads_at_other_layouts(report, case):
    r = report[case]
    assert r["loaded"] == 0.0, r  # the same weights, main weights and moments
    assert r["final vs std"] <= 1e-6 and r["metrics vs std"] <= 1e-6, r
    # Against the uninterrupted DP2 run: fp32 reduction-order noise; in bf16 the activations
    # round differently at TP2, so a weight may move by one bf16 ulp (2**-8 in [0.5, 1)).
    assert r["final vs DP2"] <= (1e-5 if case.startswith("fp32") else 2.0**-7), r


def test_shim_is_a_no_op_with_apex_or_te(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    from megatron_rl.actor import distopt_compat

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    before = distopt_compat.active()
    distopt_compat.uninstall()
    try:
        assert distopt_compat.install() is False and distopt_compat.active() == ()
    finally:
        monkeypatch.undo()
        if before:
            distopt_compat.install()
    with pytest.raises(ValueError, match="unknown distopt_compat patch"):
        distopt_compat.install(exclude=("nope",))


E2E = ("parallel.tp=1", "parallel.pp=1", "parallel.dp=2", "optim.use_distributed_optimizer=true",
       "sft.steps=3", "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=3",
       "trainer.plots=false",
       "rollout.dynamic_sampling=false", "data.val_size=16")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_run_resumes_to_the_same_metrics(tmp_path):
    """Both runs: the CLI in place on two spawned ranks (as under torchrun)."""
    config = os.path.join(ROOT, "examples", "tiny_dapo.yaml")
    train_in_ranks(2, config, tmp_path, *E2E)
    full = metrics(tmp_path)
    # As if the job had been killed right after its first checkpoint: ``latest`` names step 0
    # (later checkpoints are overwritten, later metric rows dropped on resume).
    (tmp_path / "checkpoints" / "latest").write_text("step_0000000")
    out = train_in_ranks(2, config, tmp_path, *E2E)
    assert "resumed from checkpoint at step 1" in out
    assert metrics(tmp_path) == full and len(full) == 4


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_checkpoint_loads_across_precisions(report):
    assert report["fp32->bf16"] == 0.0 and report["bf16->fp32"] == 0.0, report
