"""Actor checkpoints (issue 4): reshard on load, bit-identical resume after SIGKILL, NaN guard."""

import os
import signal

import pytest
import torch
from test_actor_layout import GLOBAL_SEQS, loss_config, make_global_batch

from megatron_rl.parallel.launch import WorkerError, spawn


def _rows(dp: int):
    from megatron.core import parallel_state as ps

    r = ps.get_data_parallel_rank()
    return slice(r * GLOBAL_SEQS // dp, (r + 1) * GLOBAL_SEQS // dp)


def _make_actor(dp: int, steps: int):
    from megatron_rl.actor.actor import Actor
    from megatron_rl.actor.optim import OptimConfig
    from megatron_rl.actor.train_step import ActorConfig
    from megatron_rl.models.config import get_preset

    return Actor(get_preset("tiny"), ActorConfig(micro_batch_size=GLOBAL_SEQS // dp // 2,
                                                 max_consecutive_skips=2),
                 OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, lr_warmup_steps=2),
                 loss_config(), total_steps=steps, seed=7)


def _step_batch(step: int, dp: int, inject_inf: bool = False) -> tuple[dict, torch.Tensor]:
    full = make_global_batch(seed=100 + step)
    batch = {k: v[_rows(dp)].clone() for k, v in full.items()}
    if inject_inf:
        batch["advantages"][0, 5] = float("inf")
    return batch, batch.pop("old_noise")


def _train(actor, dp: int, start: int, steps: int, root: str | None, kill_after: int | None,
           inf_steps: tuple = ()) -> list:
    history = []
    for step in range(start, steps):
        batch, noise = _step_batch(step, dp, inject_inf=step in inf_steps)
        actor.add_old_logprobs(batch)
        if "old_logp" in batch:
            batch["old_logp"] = batch["old_logp"] + noise * batch["mask"]
        history += actor.update(batch, step)
        if root is not None:
            actor.save(root, step, {"data_position": step + 1})
        if kill_after == step:
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # the job dies between two steps
    return history


def _report(actor, history) -> dict | None:
    from megatron.core import parallel_state as ps

    from megatron_rl.models.weights import gather_full_state_dict

    eval_batch = {k: v for k, v in make_global_batch(seed=999).items() if k in ("tokens", "mask")}
    lp = actor.logprobs(eval_batch)
    state = gather_full_state_dict(actor.model)
    out = None
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_data_parallel_rank() == 0:
        out = {"history": history, "logp": lp["logp"], "entropy": lp["entropy"]}
    if torch.distributed.get_rank() == 0:
        out = dict(out or {}, state=state)
    return out


def _ckpt_worker(tp: int, pp: int, dp: int, root: str, steps: int, resume: bool,
                 kill_after: int | None, inf_steps: tuple = ()) -> dict | None:
    from megatron_rl.parallel import runtime

    runtime.init_parallel(tp=tp, pp=pp, dp=dp, timeout_s=120)
    actor = _make_actor(dp, steps)
    start = 0
    if resume:
        info = actor.resume(root)
        start = info["trainer"]["data_position"]
    history = _train(actor, dp, start, steps, root, kill_after, inf_steps)
    out = _report(actor, history)
    if out is not None and torch.distributed.get_rank() == 0:
        import multiprocessing

        # a synchronous save leaves no helper process behind (megatron's Manager queue)
        out["children"] = [p.name for p in multiprocessing.active_children()]
    runtime.shutdown()
    return out


def run(tp, pp, dp, root, steps, resume=False, kill_after=None, inf_steps=()) -> dict:
    merged: dict = {}
    root = None if root is None else str(root)
    for r in spawn(_ckpt_worker, tp * pp * dp, (tp, pp, dp, root, steps, resume, kill_after,
                                                inf_steps), timeout_s=400):
        merged.update(r or {})
    return merged


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_save_tp2pp2_load_other_layouts(tmp_path):
    saved = run(2, 2, 1, tmp_path, steps=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_0000000"]
    assert saved["children"] == []
    for tp, pp in [(1, 1), (1, 2)]:
        loaded = run(tp, pp, 1, tmp_path, steps=1, resume=True)  # loads, trains 0 more steps
        m = make_global_batch(seed=999)["mask"]
        assert torch.allclose(loaded["logp"][m], saved["logp"][m], atol=1e-5, rtol=0)
        assert torch.allclose(loaded["entropy"][m], saved["entropy"][m], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_and_resume_is_bit_identical(tmp_path):
    full = run(1, 2, 1, tmp_path / "a", steps=3)
    with pytest.raises(WorkerError, match="died"):
        run(1, 2, 1, tmp_path / "b", steps=3, kill_after=0)
    assert open(tmp_path / "b" / "latest").read() == "step_0000000"
    resumed = run(1, 2, 1, tmp_path / "b", steps=3, resume=True)
    for k in full["state"]:
        assert torch.equal(full["state"][k], resumed["state"][k]), k
    assert full["history"][1:] == resumed["history"]  # steps 1 and 2, every metric, exactly


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nonfinite_update_is_skipped(tmp_path):
    """An inf advantage at step 1 is caught: weights equal a run that never had step 1's update,
    and two consecutive bad steps stop the run with a clear error."""
    clean = run(1, 1, 1, None, steps=1)  # step 0 only
    guarded = run(1, 1, 1, None, steps=2, inf_steps=(1,))  # step 0, then a poisoned step 1
    assert guarded["history"][1]["actor/skipped"] == 1.0
    for k in clean["state"]:
        assert torch.equal(clean["state"][k], guarded["state"][k]), k
    with pytest.raises(WorkerError, match="NonFiniteError: 2 consecutive non-finite updates"):
        run(1, 1, 1, None, steps=3, inf_steps=(1, 2))
