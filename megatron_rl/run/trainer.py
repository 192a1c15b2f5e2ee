"""The RL loop (SPMD: every rank runs :func:`train`; rank 0's :class:`RolloutDriver` also owns
prompts, the rollout engine, logging and early stopping, and broadcasts what the others need).

    for step in steps:
        batch    = driver.collect(step)              # rollout, rewards, filters (rank 0);
                                                     # each rank receives its DP rows
        batch   += actor.old_logprobs(batch); batch += actor.ref_logprobs(batch)
        metrics += collapse_metrics(actor, cross-scoring rows)   # multi-turn, every N steps
        batch   += actor.teacher_logprobs(batch)     # distillation: teacher scores the samples
        metrics  = actor.update(batch)               # losses of ALGORITHMS.md
        sync_weights(actor -> engine)
        validate / log / early stop / checkpoint

With ``rollout.max_staleness: K > 0`` a producer thread on rank 0 generates the next batches
while the actor trains (:mod:`megatron_rl.rollout.async_rollout`): ``driver.collect`` takes the
step's batch from it and the sync tells it the new version.

With ``rollout.sglang.colocate`` the servers and the actor take turns with the GPUs around these
phases (:mod:`megatron_rl.run.colocation`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from megatron_rl.config.sections import RunConfig
from megatron_rl.metrics.step import Phases, last_stage_metrics, measured_entropy
from megatron_rl.parallel.runtime import broadcast_object
from megatron_rl.rollout.sync import sync_weights
from megatron_rl.run.colocation import Colocation
from megatron_rl.run.driver import RolloutDriver


def train(cfg: RunConfig) -> dict[str, Any] | None:
    """Run the whole job; returns the summary on rank 0 (None elsewhere)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.actor.checkpoint import latest_checkpoint
    from megatron_rl.config.teacher import actor_teacher
    from megatron_rl.metrics.collapse import collapse_metrics
    from megatron_rl.metrics.host import host_stats
    from megatron_rl.metrics.tracking import gpu_stats
    from megatron_rl.metrics.update import aggregate_updates, logp_mismatch
    from megatron_rl.parallel import runtime
    from megatron_rl.parallel.restart import restart_count
    from megatron_rl.rollout.distill import add_distillation
    from megatron_rl.rollout.late_advantages import add_late_advantages, needs_reference
    from megatron_rl.run import setup
    from megatron_rl.run.guard import prune_checkpoints, write_config
    from megatron_rl.run.warm_start import initial_weights, reference_weights

    t_start = time.perf_counter()
    t = cfg.trainer
    setup.init_parallel(cfg)  # backend, update and host-group timeouts: docs/gpu.md
    ckpt_root = os.path.join(t.output_dir, "checkpoints")
    loss_cfg = setup.loss_config(cfg)  # + the distillation loss term (teacher.mode: loss)
    if runtime.is_rank0():
        write_config(cfg)  # keeps a changed predecessor as config.<n>.json
    tok = setup.make_tokenizer(cfg)
    driver = RolloutDriver(cfg, tok, setup.score_fn(cfg))

    # --- actor: resume, or warm start ----------------------------------------------------------
    # an in-job restart (trainer.max_restarts) resumes from the newest checkpoint in any case
    restarted = restart_count() > 0
    resuming = (t.resume or restarted) and broadcast_object(
        latest_checkpoint(ckpt_root) if runtime.is_rank0() else None) is not None
    init_state = None
    if not resuming:
        init_state, _ = initial_weights(cfg, tok, driver.train_rows, setup.make_actor)
    controller = setup.entropy_controller(cfg)
    # LoRA: the checkpoints hold the adapters only; a resumed run rebuilds its frozen base from
    # the initial weights, which are kept like a reference policy's
    lora = cfg.actor.lora.enabled
    ref_state = reference_weights(t.output_dir, loss_cfg.use_kl_loss or needs_reference(cfg)
                                  or lora, init_state, resuming)
    actor = setup.make_actor(
        cfg, cfg.optim, loss_cfg, t.total_steps * setup.opt_steps_per_rl_step(cfg),
        full_state=ref_state if lora and resuming else init_state, entropy_controller=controller,
        use_reference=needs_reference(cfg), ref_state=ref_state,
        with_teacher=actor_teacher(cfg.teacher))  # engine sglang: rank 0 asks the servers
    critic = setup.make_critic(cfg, init_state) if t.advantage == "gae" else None
    critic_root = os.path.join(t.output_dir, "critic_checkpoints")
    for part in (actor, critic):  # trainer.async_save: writes overlap the next steps
        if part is not None:
            part.saver.async_save = t.async_save
    if t.async_save and runtime.is_rank0() and hasattr(actor, "run_cfg"):
        print("[train] trainer.async_save with HF exports (trainer.export_hf): each export "
              "waits for its checkpoint's write, so saves do not overlap training; set "
              "trainer.export_hf=false for asynchronous saves", flush=True)
    del init_state
    start = driver.load_state_dict(actor.resume(ckpt_root)["trainer"]) if resuming else 0
    if critic is not None and resuming:
        critic.resume(critic_root)

    if resuming and runtime.is_rank0():
        print(f"[train] resumed from checkpoint at step {start}", flush=True)
    colo = Colocation(cfg, actor, driver, critic)  # rollout.sglang.colocate: take turns with GPUs
    colo.before_engine_start()
    driver.start(setup.make_engine, start, resuming, restarted)
    colo.sync(sync_weights, actor, driver.engine, cfg.rollout.weight_sync_bucket_mb,
              version=start)
    driver.validate_start()
    driver.start_async(start, version=start)  # rollout.max_staleness > 0: generation runs ahead

    dp = ps.get_data_parallel_world_size()
    mini = cfg.actor.mini_batch_size
    rows_multiple = mini or dp * (1 if cfg.actor.max_tokens_per_micro_batch else
                                  cfg.actor.micro_batch_size)
    reporter = runtime.last_stage_rank()
    val_acc = driver.last_val()
    step = start
    for step in range(start, t.total_steps):
        ph = Phases(step)  # phase timers (and fault-injection markers, tools/chaos.py)
        with ph("rollout"):  # each rank receives its DP rows only
            local, metrics = driver.collect(step, rows_multiple, dp, mini)
        if local is None:  # every group filtered out (RV filter): nothing to train this step
            driver.skip_step(step, metrics)
            if cfg.rollout.max_staleness:  # same weights, next version: the producer goes on
                colo.sync(sync_weights, actor, driver.engine, cfg.rollout.weight_sync_bucket_mb,
                          version=step + 1)
                driver.published(step + 1)
            continue
        colo.after_rollout(ph)  # colocated: servers release their memory, the actor returns
        runtime.move_batch_(local, runtime.device())  # once: every pass below reads it there
        with ph("old_logp"):
            actor.add_old_logprobs(local)
        with ph("ref_logp"):
            actor.add_ref_logprobs(local)
        collapse: dict = {}
        if driver.collapse_due(step):  # trainer.collapse_metrics: the rollout weights' H(Z|X)...
            with ph("collapse"):
                collapse = collapse_metrics(actor, *driver.collapse_rows(dp))
        if actor.teacher_model is not None:
            with ph("teacher"):
                actor.add_teacher_logprobs(local)
        # last stage: REINFORCE++ advantages (KL in the reward), rollout-vs-actor log-prob gap,
        # then the distillation signal (reward mode: on top of the task advantages)
        extra = {**add_late_advantages(local, t.advantage, t.kl_in_reward_coef),
                 **logp_mismatch(local)}
        extra.update(add_distillation(local, cfg.teacher))
        extra.update(collapse)
        if critic is not None:
            with ph("values"):
                critic.add_advantages(local)  # values -> GAE advantages and returns
        with ph("update"):
            upd = actor.update(local, step) if critic is None or critic.actor_trains(step) else []
            upd = critic.update(local, step, upd) if critic is not None else upd
        with ph("weight_sync"):
            colo.sync(sync_weights, actor, driver.engine, cfg.rollout.weight_sync_bucket_mb,
                      version=step + 1)
        driver.published(step + 1)
        if controller is not None and "old_logp" in local:
            controller.update(measured_entropy(local))
        do_val = (step + 1) % t.test_freq == 0 or step + 1 == t.total_steps
        evals: dict = {}
        if do_val:
            with ph("validation"):
                val_acc = driver.validate()
                evals = driver.evaluate_sets(step + 1)  # data.eval_sets: eval/<set>/pass@k ...
        step_upd = {**aggregate_updates(upd), **extra}  # all mini-batches and epochs
        metrics = {**metrics, **evals, **last_stage_metrics([step_upd], reporter), **ph.times,
                   **gpu_stats(), **host_stats()}
        decision = driver.finish_step(step, metrics, val_acc if do_val else None)
        if (step + 1) % t.save_freq == 0 or step + 1 == t.total_steps or decision.stop:
            with colo.resident():
                actor.save(ckpt_root, step, driver.state_dict(step + 1))
                if critic is not None:
                    critic.save(critic_root, step)
            if runtime.is_rank0():
                prune_checkpoints(ckpt_root, t.keep_checkpoints)
                if critic is not None:
                    prune_checkpoints(critic_root, t.keep_checkpoints)
        if decision.stop:
            if runtime.is_rank0():
                print(f"[train] early stop at step {step + 1}: {decision.reason}", flush=True)
            break
    actor.wait_for_save()  # an asynchronous save in flight is published before exit
    if critic is not None:
        critic.wait_for_save()
    summary = driver.close(val_acc, time.perf_counter() - t_start, step + 1)
    runtime.shutdown()
    return summary
