"""The non-RL jobs: ``eval`` (validation accuracy of the newest checkpoint) and ``sft`` (the
supervised warm start alone). Both are SPMD over the run's layout, like ``train``."""

from __future__ import annotations

import os

import torch

from megatron_rl.config.sections import RunConfig


def evaluate(cfg: RunConfig) -> float | None:
    """Validation accuracy of the newest checkpoint under ``trainer.output_dir`` (SPMD)."""
    from megatron_rl.actor.checkpoint import latest_checkpoint
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.sync import sync_weights
    from megatron_rl.run import setup
    from megatron_rl.run.driver import RolloutDriver

    setup.init_parallel(cfg)
    root = os.path.join(cfg.trainer.output_dir, "checkpoints")
    path = latest_checkpoint(root)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {root} (train first, or set output_dir)")
    actor = setup.make_actor(cfg, cfg.optim, cfg.loss.build(), 1)
    info = actor.resume(root)
    driver = RolloutDriver(cfg, setup.make_tokenizer(cfg), setup.score_fn(cfg))
    engine = setup.make_engine(cfg, driver.tok) if runtime.is_rank0() else None
    driver.engine = engine
    sync_weights(actor, engine, cfg.rollout.weight_sync_bucket_mb, version=info["step"] + 1)
    acc = driver.validate()
    if runtime.is_rank0():
        print(f"eval: val_acc={acc:.4f} checkpoint={path} (after step {info['step'] + 1})",
              flush=True)
    runtime.shutdown()
    return acc


def sft_only(cfg: RunConfig) -> str | None:
    """Run the supervised warm start alone; write canonical weights to
    ``output_dir/sft_weights.pt`` (start RL from them with ``model.init_weights=...``)."""
    from megatron_rl.parallel import runtime
    from megatron_rl.run import setup
    from megatron_rl.run.driver import RolloutDriver
    from megatron_rl.run.sft import run_sft

    setup.init_parallel(cfg)
    driver = RolloutDriver(cfg, setup.make_tokenizer(cfg), setup.score_fn(cfg))
    state, _ = run_sft(cfg, driver.tok, driver.train_rows, setup.make_actor)
    path = None
    if runtime.is_rank0():
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        path = os.path.join(cfg.trainer.output_dir, "sft_weights.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"sft: wrote {path}", flush=True)
    runtime.shutdown()
    return path
