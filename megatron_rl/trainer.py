"""The RL loop (SPMD: every rank runs :func:`train`; rank 0's :class:`RolloutDriver` also owns
prompts, the rollout engine, logging and early stopping, and broadcasts what the others need).

    for step in steps:
        batch    = driver.collect(step)              # rollout, rewards, filters (rank 0)
        batch   += actor.old_logprobs(batch); batch += actor.ref_logprobs(batch)
        metrics  = actor.update(batch)               # losses of ALGORITHMS.md
        sync_weights(actor -> engine)
        validate / log / early stop / checkpoint
"""

from __future__ import annotations

import os
import time
from typing import Any

from megatron_rl.config import RunConfig
from megatron_rl.driver import RolloutDriver, broadcast_object, write_run_config
from megatron_rl.rollout.sync import sync_weights
from megatron_rl.step_metrics import Phases, last_stage_metrics, measured_entropy


def train(cfg: RunConfig) -> dict[str, Any] | None:
    """Run the whole job; returns the summary on rank 0 (None elsewhere)."""
    from megatron.core import parallel_state as ps

    from megatron_rl import run_setup as setup
    from megatron_rl.actor.checkpoint import latest_checkpoint
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.collect import dp_rows
    from megatron_rl.tracking import gpu_stats
    from megatron_rl.warm_start import initial_weights, reference_weights

    t_start = time.perf_counter()
    p, t = cfg.parallel, cfg.trainer
    runtime.init_parallel(tp=p.tp, pp=p.pp, dp=p.dp, seed=t.seed, timeout_s=900)
    ckpt_root = os.path.join(t.output_dir, "checkpoints")
    loss_cfg = cfg.loss.build()
    write_run_config(cfg)
    tok = setup.make_tokenizer(cfg)
    driver = RolloutDriver(cfg, tok, setup.score_fn(cfg))

    # --- actor: resume, or warm start ----------------------------------------------------------
    resuming = t.resume and broadcast_object(
        latest_checkpoint(ckpt_root) if runtime.is_rank0() else None) is not None
    init_state = None
    if not resuming:
        init_state, _ = initial_weights(cfg, tok, driver.train_rows, setup.make_actor)
    controller = setup.entropy_controller(cfg)
    actor = setup.make_actor(
        cfg, cfg.optim, loss_cfg, t.total_steps * setup.opt_steps_per_rl_step(cfg),
        full_state=init_state, entropy_controller=controller,
        ref_state=reference_weights(t.output_dir, loss_cfg.use_kl_loss, init_state, resuming))
    del init_state
    start = driver.load_state_dict(actor.resume(ckpt_root)["trainer"]) if resuming else 0
    if resuming and runtime.is_rank0():
        print(f"[train] resumed from checkpoint at step {start}", flush=True)
    driver.start(setup.make_engine, start, resuming)
    sync_weights(actor, driver.engine, cfg.rollout.weight_sync_bucket_mb, version=start)
    driver.validate_start()

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mini = cfg.actor.mini_batch_size
    rows_multiple = mini or dp * cfg.actor.micro_batch_size
    reporter = runtime.last_stage_rank()
    val_acc = driver.last_val()
    step = start
    for step in range(start, t.total_steps):
        ph = Phases()
        with ph("rollout"):
            batch, metrics = driver.collect(step, rows_multiple)
        if batch is None:  # every group filtered out (RV filter): nothing to train this step
            driver.skip_step(step, metrics)
            continue
        local = {k: v[dp_rows(batch["tokens"].shape[0], dp, dp_rank, mini)]
                 for k, v in batch.items()}
        with ph("old_logp"):
            actor.add_old_logprobs(local)
        with ph("ref_logp"):
            actor.add_ref_logprobs(local)
        with ph("update"):
            upd = actor.update(local, step)
        with ph("weight_sync"):
            sync_weights(actor, driver.engine, cfg.rollout.weight_sync_bucket_mb,
                         version=step + 1)
        if controller is not None and "old_logp" in local:
            controller.update(measured_entropy(local))
        do_val = (step + 1) % t.test_freq == 0 or step + 1 == t.total_steps
        if do_val:
            with ph("validation"):
                val_acc = driver.validate()
        metrics = {**metrics, **last_stage_metrics(upd, reporter), **ph.times,
                   **gpu_stats()}
        decision = driver.finish_step(step, metrics, val_acc if do_val else None)
        if (step + 1) % t.save_freq == 0 or step + 1 == t.total_steps or decision.stop:
            actor.save(ckpt_root, step, driver.state_dict(step + 1))
        if decision.stop:
            if runtime.is_rank0():
                print(f"[train] early stop at step {step + 1}: {decision.reason}", flush=True)
            break
    summary = driver.close(val_acc, time.perf_counter() - t_start, step + 1)
    runtime.shutdown()
    return summary
