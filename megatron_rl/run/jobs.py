"""The non-RL jobs: ``eval`` (validation accuracy and evaluation sets of a checkpoint or a
model; :mod:`megatron_rl.eval.targets`) and ``sft`` (the supervised warm start alone). Both are
SPMD over the run's layout, like ``train``."""

from __future__ import annotations

import os

import torch

from megatron_rl.config.sections import RunConfig


def evaluate(cfg: RunConfig, request: dict | None = None) -> float | None:
    """The ``eval`` job (SPMD over the run's layout): load the target's weights into the actor,
    sync them to the rollout engine (embedded or the SGLang fleet), score the validation split
    (run targets) and every ``data.eval_sets`` set; on rank 0 print the table and write
    ``eval/<set>.json``. ``request``: :class:`~megatron_rl.eval.targets.EvalRequest` as a dict
    (None: the newest checkpoint of ``trainer.output_dir``, the form ``eval CONFIG`` always had).
    Returns the validation accuracy (None where it was not scored and on other ranks)."""
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.sync import sync_weights
    from megatron_rl.run import setup
    from megatron_rl.run.driver import RolloutDriver

    req = request or {"kind": "config", "target": None, "step": None, "validate": True,
                      "out_dir": os.path.join(cfg.trainer.output_dir, "eval")}
    setup.init_parallel(cfg)
    actor, version, what = _eval_actor(cfg, req)
    driver = RolloutDriver(cfg, setup.make_tokenizer(cfg), setup.score_fn(cfg))
    engine = setup.make_engine(cfg, driver.tok) if runtime.is_rank0() else None
    driver.engine = engine
    sync_weights(actor, engine, cfg.rollout.weight_sync_bucket_mb, version=version)
    acc = driver.validate() if req["validate"] else None
    if runtime.is_rank0():
        if acc is not None:
            print(f"eval: val_acc={acc:.4f} {what}", flush=True)
        _eval_sets(cfg, driver, req, what)
        getattr(engine, "close", lambda: None)()
    runtime.shutdown()
    return acc


def _eval_actor(cfg: RunConfig, req: dict):
    """``(actor holding the target's weights, weight version, description)``; collective."""
    from megatron_rl.actor.checkpoint import load_checkpoint
    from megatron_rl.run import setup
    from megatron_rl.run.export import checkpoint_for_step

    if req["kind"] in ("hf", "megatron"):
        from megatron_rl.convert.model_source import weight_source

        actor = setup.make_actor(cfg, cfg.optim, cfg.loss.build(), 1,
                                 full_state=weight_source(cfg.model))
        return actor, 0, f"model={req['target']}"
    try:
        path = checkpoint_for_step(cfg.trainer.output_dir, req.get("step"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc} (train first, or set output_dir)") from None
    actor = setup.make_actor(cfg, cfg.optim, cfg.loss.build(), 1)
    info = load_checkpoint(path, actor.ddp, actor.optimizer, actor.scheduler)
    return actor, info["step"] + 1, f"checkpoint={path} (after step {info['step'] + 1})"


def _eval_sets(cfg: RunConfig, driver, req: dict, what: str) -> None:
    """Rank 0: every set of ``driver.eval_sets`` with a progress bar; the table on stdout and
    ``eval/<set>.json`` under ``req["out_dir"]``."""
    from megatron_rl.eval.report import format_table, write_result
    from megatron_rl.eval.sets import EVAL_CHUNK, evaluate_set
    from megatron_rl.util.progress import Progress

    if not driver.eval_sets:
        return
    rows = []
    for es in driver.eval_sets:
        n = es.spec["n"]
        with Progress(len(es.rows) * n, f"eval {es.name}", unit="samples") as bar:
            res = evaluate_set(driver.engine, driver.tok, es, seed=cfg.trainer.seed,
                               timeout_s=cfg.rollout.reward_timeout_s, chunk=EVAL_CHUNK,
                               progress=lambda done, _total, b=bar, m=n: b.set(done * m))
        meta = {"target": req["target"], "kind": req["kind"], "weights": what,
                "source": es.source, "dropped_prompts": es.dropped,
                "engine": cfg.rollout.engine, "seed": cfg.trainer.seed}
        path = write_result(req["out_dir"], res, meta)
        print(f"[eval] {es.name}: {len(es.rows)} prompts x {n} samples in {res.wall_s:.1f} s "
              f"-> {path}", flush=True)
        rows.append((es.name, res.metrics))
    print(f"eval: {what}\n{format_table(rows)}", flush=True)


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
