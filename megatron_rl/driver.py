"""Rank 0's share of the RL loop: prompts, rollout engine, rewards, validation, logging and early
stopping. Every method is called on all ranks (SPMD); rank 0 does the work and the results the
other ranks need (the batch, the stop decision) are broadcast, so the loop has no rank branches.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_rl.config import RunConfig


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (host objects, pickled, over the gloo host group)."""
    from megatron_rl.parallel.runtime import broadcast_object as host_broadcast

    return host_broadcast(obj, src)


class RolloutDriver:
    """Prompts, engine, tracker and early stopper, held by rank 0 (``None`` parts elsewhere)."""

    def __init__(self, cfg: RunConfig, tokenizer, score_fn) -> None:
        from megatron_rl.data import PromptLoader
        from megatron_rl.early_stop import EarlyStopper
        from megatron_rl.run_setup import build_datasets

        self.cfg, self.tok, self.score_fn = cfg, tokenizer, score_fn
        self.rank0 = dist.get_rank() == 0
        self.train_rows = self.val_rows = self.loader = None
        if self.rank0 and cfg.env.name:  # multi-turn envs: seeds instead of prompts
            from megatron_rl.rollout.multiturn import EnvSeedLoader, env_sft_rows

            self.train_rows = env_sft_rows(cfg, tokenizer, 256) if cfg.sft.steps else None
            self.loader = EnvSeedLoader(cfg.trainer.train_batch_size, cfg.env.seed)
        elif self.rank0:  # only rank 0 reads prompts
            train_set, val_set = build_datasets(cfg)
            self.train_rows, self.val_rows = train_set.rows, val_set.rows
            self.loader = PromptLoader(train_set, cfg.rollout.gen_batch_size or
                                       cfg.trainer.train_batch_size, seed=cfg.data.seed)
        self.stopper = EarlyStopper(**_early_stop_kwargs(cfg))
        self.engine = self.tracker = None
        self.history: list[dict] = []
        self.val_start: float | None = None

    def start(self, make_engine, start_step: int, resuming: bool) -> None:
        """Create the engine and the metrics tracker (rank 0)."""
        from megatron_rl.step_metrics import PROGRESS_KEYS
        from megatron_rl.tracking import Tracker

        if not self.rank0:
            return
        t, lg = self.cfg.trainer, self.cfg.logging
        self.engine = make_engine(self.cfg, self.tok)
        self.tracker = Tracker(t.output_dir, total_steps=t.total_steps,
                               use_tensorboard=lg.tensorboard, use_wandb=lg.wandb,
                               project=lg.project, config=self.cfg.to_dict(),
                               resume_step=start_step if resuming else None,
                               progress_keys=PROGRESS_KEYS)

    # ---- rollout ------------------------------------------------------------------------------
    def collect(self, step: int, rows_multiple: int) -> tuple[dict | None, dict]:
        """Generate, score and filter one step's responses; the padded batch on every rank
        (None when every group was filtered out) and the rollout metrics."""
        from megatron_rl.rollout.collect import collect_step, records_to_batch

        batch = metrics = None
        if self.rank0 and self.cfg.env.name:
            from megatron_rl.rollout.multiturn import collect_env_step, episodes_to_batch

            records, metrics = collect_env_step(self.engine, self.tok, self.loader, self.cfg, step)
            if records:
                batch = episodes_to_batch(records, self.cfg.trainer.advantage, self.tok.pad_id,
                                          rows_multiple)
        elif self.rank0:
            records, metrics = collect_step(self.engine, self.tok, self.loader, self.cfg,
                                            self.score_fn, step)
            if records:
                batch = records_to_batch(records, self.cfg.trainer.advantage, self.tok.pad_id,
                                         rows_multiple)
        return broadcast_object((batch, metrics))

    def validate(self) -> float | None:
        """Validation accuracy on rank 0 (greedy unless ``rollout.val_temperature > 0``)."""
        if self.engine is None:
            return None
        if self.cfg.env.name:
            from megatron_rl.rollout.multiturn import validate_envs

            return validate_envs(self.engine, self.tok, self.cfg)
        from megatron_rl.rollout.collect import generate_records
        from megatron_rl.rollout.engine import SamplingParams

        r = self.cfg.rollout
        params = SamplingParams(n=r.val_n, max_new_tokens=r.max_new_tokens,
                                temperature=r.val_temperature or 1.0,
                                greedy=r.val_temperature == 0)
        recs = generate_records(self.engine, self.tok, self.val_rows, params, self.score_fn,
                                seed=self.cfg.trainer.seed)
        return sum(x["acc"] for x in recs) / max(1, len(recs))

    def validate_start(self) -> float | None:
        """Validation right after the warm start (once per run, kept across resumes)."""
        if self.val_start is None:
            self.val_start = self.validate()
            if self.rank0:
                self.tracker.log({"val/acc": self.val_start}, step=0)
                print(f"[train] validation accuracy after warm start: {self.val_start:.3f}",
                      flush=True)
        return self.val_start

    def last_val(self) -> float | None:
        return self.history[-1].get("val/acc", self.val_start) if self.history else self.val_start

    # ---- logging and early stopping ------------------------------------------------------------
    def skip_step(self, step: int, metrics: dict) -> None:
        """Every group was filtered out: log it, count it for the early stopper."""
        if self.rank0:
            print(f"[train] step {step + 1}: no trainable groups after filtering; skipped",
                  flush=True)
            self.stopper.update_train(float("nan"), trained=False)
            self.tracker.log(metrics, step=step + 1)

    def finish_step(self, step: int, metrics: dict, val_acc: float | None):
        """Log the step's metrics, update the early stopper; the decision on every rank."""
        decision = None
        if self.rank0:
            decision = self.stopper.update_train(metrics.get("rollout/in_group_reward_std",
                                                             float("nan")))
            if val_acc is not None:
                metrics["val/acc"] = val_acc
                decision = self.stopper.update_val(val_acc)
            metrics.update(decision.metrics)
            self.history.append({k: v for k, v in metrics.items()
                                 if k in ("val/acc", "rollout/acc")})
            self.tracker.log(metrics, step=step + 1)
        return broadcast_object(decision)

    # ---- checkpointed state --------------------------------------------------------------------
    def state_dict(self, next_step: int) -> dict:
        """The trainer's part of a checkpoint (the same object on every rank)."""
        state = {"next_step": next_step, "history": self.history, "val_start": self.val_start,
                 "early_stop": self.stopper.state_dict() if self.rank0 else None,
                 "loader": self.loader.state_dict() if self.rank0 else None}
        return broadcast_object(state)

    def load_state_dict(self, st: dict) -> int:
        """Restore from a checkpoint's trainer state; returns the next step."""
        self.history, self.val_start = st.get("history", []), st.get("val_start")
        self.stopper.load_state_dict(st["early_stop"])
        if self.rank0:
            self.loader.load_state_dict(st["loader"])
        return st["next_step"]

    def close(self, val_acc: float | None, wall_s: float, steps: int) -> dict | None:
        """Final validation if none ran, plots, the summary line; the summary on rank 0."""
        if not self.rank0:
            return None
        if val_acc is None:
            val_acc = self.validate()
        summary = {"val_acc_start": self.val_start, "val_acc_end": val_acc, "wall_s": wall_s,
                   "steps": steps}
        self.tracker.close()
        getattr(self.engine, "close", lambda: None)()  # an SGLang fleet stops its processes
        if self.cfg.trainer.plots:
            try:
                from megatron_rl.plot import plot_run
                plot_run(self.cfg.trainer.output_dir)
            except Exception as exc:  # noqa: BLE001 - plotting never fails a finished run
                print(f"[train] plotting skipped: {exc}", flush=True)
        print(f"summary: val_acc_start={self.val_start:.4f} val_acc_end={val_acc:.4f} "
              f"wall_s={wall_s:.1f}", flush=True)
        return summary


def _early_stop_kwargs(cfg: RunConfig) -> dict:
    e = cfg.early_stop
    return {"enabled": e.enabled, "rv_baseline_steps": e.rv_warmup_steps,
            "rv_patience": e.rv_patience, "rv_ratio": e.rv_ratio,
            "val_threshold": e.val_threshold, "val_patience": e.val_patience}
