"""The RL loop (SPMD: every rank runs :func:`train`; rank 0 also owns the rollout engine).

    warm start (SFT) -> sync weights -> validate
    for each step:
        rollout -> rewards -> filters (rank 0)      broadcast the batch
        old-policy pass -> advantages -> update     (all ranks, megatron pipeline)
        weight sync -> validation -> checkpoint -> log / early stop
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig

PROGRESS_KEYS = {"reward": ("rollout/reward",), "acc": ("rollout/acc",),
                 "entropy": ("policy/entropy",)}


def _bcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Phases:
    """Wall time per phase of one step: ``with phases("rollout"): ...`` -> ``time/rollout``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}"] = time.perf_counter() - t0


def sync_weights(actor, engine, cfg: RunConfig, version: int) -> str | None:
    """Stream HF-named buckets out of the Megatron actor into the engine.

    Collective over the model-parallel group of DP replica 0 only (the engine's rank is there);
    the other replicas hold identical weights and skip the gathers entirely.
    """
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.stream import iter_hf_weight_buckets

    if ps.get_data_parallel_rank() != 0:
        return None
    buckets = iter_hf_weight_buckets(actor.model, cfg.rollout.weight_sync_bucket_mb * 2**20,
                                     broadcast_pp=True)
    if engine is not None:
        return engine.update_weights(buckets, version)
    for _ in buckets:
        pass
    return None


def validate(engine, tokenizer, rows, cfg: RunConfig, score_fn) -> float | None:
    """Validation accuracy on rank 0 (greedy unless ``rollout.val_temperature > 0``)."""
    if engine is None:
        return None
    from megatron_rl.rollout.collect import generate_records
    from megatron_rl.rollout.engine import SamplingParams

    r = cfg.rollout
    params = SamplingParams(n=r.val_n, max_new_tokens=r.max_new_tokens,
                            temperature=r.val_temperature or 1.0, greedy=r.val_temperature == 0)
    recs = generate_records(engine, tokenizer, rows, params, score_fn, seed=cfg.trainer.seed)
    return sum(x["acc"] for x in recs) / max(1, len(recs))


def _local(batch: dict, rows: torch.Tensor) -> dict:
    return {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def make_actor(cfg: RunConfig, optim_cfg, loss_cfg, total_steps: int, full_state=None,
               entropy_controller=None, actor_cfg=None, ref_state=None):
    from megatron_rl.actor.actor import Actor
    from megatron_rl.models.config import get_preset

    return Actor(get_preset(cfg.model.preset), actor_cfg or cfg.actor, optim_cfg, loss_cfg,
                 total_steps,
                 seed=cfg.trainer.seed, full_state=full_state,
                 entropy_controller=entropy_controller, ref_state=ref_state)


def train(cfg: RunConfig) -> dict[str, Any]:
    """Run the whole job; returns the summary on rank 0 (None elsewhere)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.data import PromptDataset, PromptLoader, train_val_split
    from megatron_rl.early_stop import EarlyStopper
    from megatron_rl.parallel import runtime
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.rollout.collect import collect_step, dp_rows, records_to_batch
    from megatron_rl.sft import run_sft
    from megatron_rl.tracking import Tracker, gpu_stats

    t_start = time.perf_counter()
    p, t = cfg.parallel, cfg.trainer
    runtime.init_parallel(tp=p.tp, pp=p.pp, dp=p.dp, seed=t.seed, timeout_s=900)
    rank0 = dist.get_rank() == 0
    tok = ByteTokenizer()
    run_dir = t.output_dir
    ckpt_root = os.path.join(run_dir, "checkpoints")
    loss_cfg = cfg.loss.build()
    score_fn = _score_fn(cfg)

    # --- data (rank 0 owns prompts; everyone else receives batches) ---------------------------
    train_rows = val_rows = loader = None
    if rank0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        d = cfg.data
        full = (PromptDataset.from_files(d.path, d.prompt_field, d.answer_field) if d.path else
                PromptDataset.from_task(d.task, d.train_size + d.val_size, d.seed,
                                        **d.task_kwargs))
        train_set, val_set = train_val_split(full, d.val_size, seed=d.seed,
                                             by="prompt" if d.split_by == "prompt" else None)
        train_rows, val_rows = train_set.rows, val_set.rows
        loader = PromptLoader(train_set, cfg.rollout.gen_batch_size or t.train_batch_size,
                              seed=d.seed)

    # --- actor: resume, or warm start ---------------------------------------------------------
    from megatron_rl.actor.checkpoint import latest_checkpoint

    resuming = t.resume and _bcast(latest_checkpoint(ckpt_root) if rank0 else None) is not None
    sft_state = None
    sft_log: list = []
    if not resuming and cfg.model.init_weights:
        sft_state = torch.load(cfg.model.init_weights, weights_only=True)
    elif not resuming and cfg.sft.steps > 0:
        sft_state, sft_log = run_sft(cfg, tok, train_rows, make_actor)
    controller = _entropy_controller(cfg)
    ref_state = _reference_weights(run_dir, loss_cfg.use_kl_loss, sft_state, resuming, rank0)
    actor = make_actor(cfg, cfg.optim, loss_cfg, t.total_steps * _opt_steps_per_rl_step(cfg),
                       full_state=sft_state, entropy_controller=controller, ref_state=ref_state)
    del sft_state, ref_state
    start, history, val_start = 0, [], None
    stopper = EarlyStopper(**_early_stop_kwargs(cfg))
    if resuming:
        info = actor.resume(ckpt_root)
        st = info["trainer"]
        start, history, val_start = st["next_step"], st.get("history", []), st.get("val_start")
        stopper.load_state_dict(st["early_stop"])
        if rank0:
            loader.load_state_dict(st["loader"])
    engine = None
    if rank0:
        from megatron_rl.models.config import get_preset
        from megatron_rl.rollout.embedded import EmbeddedEngine
        engine = EmbeddedEngine(get_preset(cfg.model.preset), tok.eos_id, tok.pad_id)
    tracker = Tracker(run_dir, total_steps=t.total_steps, use_tensorboard=cfg.logging.tensorboard,
                      use_wandb=cfg.logging.wandb, project=cfg.logging.project,
                      config=cfg.to_dict(), resume_step=start if resuming else None,
                      progress_keys=PROGRESS_KEYS) if rank0 else None
    sync_weights(actor, engine, cfg, version=start)
    if val_start is None:
        val_start = validate(engine, tok, val_rows, cfg, score_fn)
        if rank0:
            tracker.log({"val/acc": val_start}, step=0)
            print(f"[train] validation accuracy after warm start: {val_start:.3f}", flush=True)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    reporter = runtime.last_stage_rank()
    mini = cfg.actor.mini_batch_size
    rows_multiple = mini or dp * cfg.actor.micro_batch_size
    val_acc = history[-1].get("val/acc", val_start) if history else val_start
    step = start
    for step in range(start, t.total_steps):
        ph = Phases()
        with ph("rollout"):
            batch = metrics = None
            if rank0:
                records, metrics = collect_step(engine, tok, loader, cfg, score_fn, step)
                if records:
                    batch = records_to_batch(records, t.advantage, tok.pad_id, rows_multiple)
            batch, metrics = _bcast((batch, metrics))
        if batch is None:  # every group filtered out (RV filter): nothing to train this step
            if rank0:
                print(f"[train] step {step + 1}: no trainable groups after filtering; skipped",
                      flush=True)
                stopper.update_train(float("nan"), trained=False)
                tracker.log(metrics, step=step + 1)
            continue
        n_rows = batch["tokens"].shape[0]
        local = _local(batch, dp_rows(n_rows, dp, dp_rank, mini if mini else n_rows))
        with ph("old_logp"):
            actor.add_old_logprobs(local)
        with ph("ref_logp"):
            actor.add_ref_logprobs(local)
        with ph("update"):
            upd = actor.update(local, step)
        with ph("weight_sync"):
            sync_weights(actor, engine, cfg, version=step + 1)
        if controller is not None and "old_logp" in local:
            controller.update(_measured_entropy(local))
        do_val = (step + 1) % t.test_freq == 0 or step + 1 == t.total_steps
        if do_val:
            with ph("validation"):
                val_acc = validate(engine, tok, val_rows, cfg, score_fn)
        upd_metrics = _last_stage_metrics(upd, reporter)
        if rank0:
            metrics = {**metrics, **upd_metrics, **ph.times, **gpu_stats()}
            if do_val:
                metrics["val/acc"] = val_acc
        decision = None
        if rank0:
            decision = stopper.update_train(metrics.get("rollout/in_group_reward_std",
                                                        float("nan")))
            if do_val:
                decision = stopper.update_val(val_acc)
        decision = _bcast(decision)
        if rank0:
            metrics.update(decision.metrics)
            history.append({k: v for k, v in metrics.items() if k in ("val/acc",
                                                                        "rollout/acc")})
            tracker.log(metrics, step=step + 1)
        if (step + 1) % t.save_freq == 0 or step + 1 == t.total_steps or decision.stop:
            with ph("checkpoint"):
                state = {"next_step": step + 1, "history": history, "val_start": val_start,
                         "early_stop": stopper.state_dict() if rank0 else None,
                         "loader": loader.state_dict() if rank0 else None}
                actor.save(ckpt_root, step, _bcast(state))
        if decision.stop:
            if rank0:
                print(f"[train] early stop at step {step + 1}: {decision.reason}", flush=True)
            break
    summary = None
    if rank0:
        if val_acc is None:
            val_acc = validate(engine, tok, val_rows, cfg, score_fn)
        summary = {"val_acc_start": val_start, "val_acc_end": val_acc,
                   "wall_s": time.perf_counter() - t_start, "steps": step + 1}
        tracker.close()
        try:
            from megatron_rl.plot import plot_run
            plot_run(run_dir)
        except Exception as exc:  # noqa: BLE001 - plotting never fails a finished run
            print(f"[train] plotting skipped: {exc}", flush=True)
        print(f"summary: val_acc_start={val_start:.4f} val_acc_end={val_acc:.4f} "
              f"wall_s={summary['wall_s']:.1f}", flush=True)
    runtime.shutdown()
    return summary


def _setup_eval(cfg: RunConfig):
    from megatron_rl.data import PromptDataset, train_val_split
    from megatron_rl.models.config import get_preset
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.rollout.embedded import EmbeddedEngine

    d = cfg.data
    full = (PromptDataset.from_files(d.path, d.prompt_field, d.answer_field) if d.path else
            PromptDataset.from_task(d.task, d.train_size + d.val_size, d.seed, **d.task_kwargs))
    _, val_set = train_val_split(full, d.val_size, seed=d.seed,
                                 by="prompt" if d.split_by == "prompt" else None)
    tok = ByteTokenizer()
    return tok, val_set.rows, EmbeddedEngine(get_preset(cfg.model.preset), tok.eos_id,
                                             tok.pad_id)


def evaluate(cfg: RunConfig) -> float | None:
    """Validation accuracy of the newest checkpoint under ``trainer.output_dir`` (SPMD)."""
    from megatron_rl.actor.checkpoint import latest_checkpoint
    from megatron_rl.parallel import runtime

    p = cfg.parallel
    runtime.init_parallel(tp=p.tp, pp=p.pp, dp=p.dp, seed=cfg.trainer.seed, timeout_s=900)
    root = os.path.join(cfg.trainer.output_dir, "checkpoints")
    path = latest_checkpoint(root)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {root} (train first, or set output_dir)")
    actor = make_actor(cfg, cfg.optim, cfg.loss.build(), 1)
    info = actor.resume(root)
    rank0 = dist.get_rank() == 0
    tok, rows, engine = _setup_eval(cfg) if rank0 else (None, None, None)
    sync_weights(actor, engine, cfg, version=info["step"] + 1)
    acc = validate(engine, tok, rows, cfg, _score_fn(cfg))
    if rank0:
        print(f"eval: val_acc={acc:.4f} checkpoint={path} (after step {info['step'] + 1})",
              flush=True)
    runtime.shutdown()
    return acc


def sft_only(cfg: RunConfig) -> str | None:
    """Run the supervised warm start alone; write canonical weights to
    ``output_dir/sft_weights.pt`` (start RL from them with ``model.init_weights=...``)."""
    from megatron_rl.data import PromptDataset, train_val_split
    from megatron_rl.parallel import runtime
    from megatron_rl.rewards.tokenizer import ByteTokenizer
    from megatron_rl.sft import run_sft

    p, d = cfg.parallel, cfg.data
    runtime.init_parallel(tp=p.tp, pp=p.pp, dp=p.dp, seed=cfg.trainer.seed, timeout_s=900)
    rank0 = dist.get_rank() == 0
    rows = None
    if rank0:
        full = (PromptDataset.from_files(d.path, d.prompt_field, d.answer_field) if d.path else
                PromptDataset.from_task(d.task, d.train_size + d.val_size, d.seed,
                                        **d.task_kwargs))
        rows = train_val_split(full, d.val_size, seed=d.seed,
                               by="prompt" if d.split_by == "prompt" else None)[0].rows
    state, _ = run_sft(cfg, ByteTokenizer(), rows, make_actor)
    path = None
    if rank0:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        path = os.path.join(cfg.trainer.output_dir, "sft_weights.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"sft: wrote {path}", flush=True)
    runtime.shutdown()
    return path


def _reference_weights(run_dir: str, needed: bool, sft_state, resuming: bool, rank0: bool):
    """Initial weights of the frozen reference policy (KL term only). A fresh run with a warm
    start writes them to ``run_dir/reference_weights.pt`` so that a resumed run finds them."""
    if not needed:
        return None
    path = os.path.join(run_dir, "reference_weights.pt")
    if not resuming:
        if rank0 and sft_state is not None:
            torch.save(sft_state, path + ".tmp")
            os.replace(path + ".tmp", path)
        return sft_state
    dist.barrier()
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


def _last_stage_metrics(history: list[dict], src: int) -> dict:
    """The update's metrics live on the last stage (global rank ``src``); bring the final
    mini-batch's to every rank."""
    last = history[-1] if history else {}
    box = [last if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return {k: v for k, v in (box[0] or {}).items()}


def _measured_entropy(local: dict) -> float:
    """-mean(old_logp) over the step's valid tokens, all DP ranks (ALGORITHMS.md §10.1)."""
    from megatron.core import parallel_state as ps

    m = local["mask"]
    sums = torch.stack([(-(local["old_logp"] * m).sum()).double(), m.sum().double()])
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1].clamp_min(1))


def _opt_steps_per_rl_step(cfg: RunConfig) -> int:
    rows = cfg.trainer.train_batch_size * cfg.rollout.n
    mini = cfg.actor.mini_batch_size or rows
    return cfg.actor.ppo_epochs * max(1, rows // mini)


def _entropy_controller(cfg: RunConfig):
    if cfg.loss.algorithm != "skywork_or1":
        return None
    from megatron_rl.loss import AdaptiveEntropyController

    return AdaptiveEntropyController()


def _early_stop_kwargs(cfg: RunConfig) -> dict:
    e = cfg.early_stop
    return {"enabled": e.enabled, "rv_baseline_steps": e.rv_warmup_steps,
            "rv_patience": e.rv_patience, "rv_ratio": e.rv_ratio,
            "val_threshold": e.val_threshold, "val_patience": e.val_patience}


def _score_fn(cfg: RunConfig):
    if cfg.rollout.reward_fn:
        from megatron_rl.rewards.plugin import load_reward_fn

        return load_reward_fn(cfg.rollout.reward_fn)
    from megatron_rl.rewards.tasks import score

    return score
