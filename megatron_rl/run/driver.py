"""Rank 0's share of the RL loop: prompts, rollout engine, rewards, validation, logging and early
stopping. Every method is called on all ranks (SPMD); rank 0 does the work and the results the
other ranks need are sent to them, so the loop has no rank branches: each rank receives only its
data-parallel rows of the step batch (:func:`scatter_rows`; the TP/PP ranks of one DP rank get
the same rows), and the small objects (metrics, the stop decision) are broadcast.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.sections import RunConfig
from megatron_rl.parallel.runtime import broadcast_object


def dp_rank_table() -> list[int]:
    """The data-parallel rank of every global rank (collective over the host group)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel.runtime import host_group

    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, ps.get_data_parallel_rank(), group=host_group())
    return [int(x) for x in table]


def _pack(rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """int64 tensors (token ids) travel as int32 when their values fit (half the bytes)."""
    out: dict[str, Any] = {}
    for k, v in rows.items():
        if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and (
                v.numel() == 0 or -2**31 <= int(v.min()) and int(v.max()) < 2**31):
            out[k] = ("int64 as int32", v.to(torch.int32))
        else:
            out[k] = v
    return out


def _unpack(rows: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v[1].to(torch.int64) if isinstance(v, tuple) and v[0] == "int64 as int32" else v
            for k, v in rows.items()}


def scatter_rows(batch: dict[str, torch.Tensor] | None, metrics: Any, table: list[int],
                 dp: int, mini: int, balance: bool = False
                 ) -> tuple[dict[str, torch.Tensor] | None, Any, int]:
    """Rank 0's step ``batch`` (host tensors ``[N, ...]``, or None on every rank but 0) ->
    ``(this rank's rows, metrics, bytes this rank received)`` on every rank.

    Rank 0 cuts the rows of each DP rank (:func:`megatron_rl.rollout.collect.dp_rows`, the order
    the loss assumes), pickles each DP rank's share once and sends it, over the gloo host group,
    to every global rank with that DP rank (``table``: :func:`dp_rank_table`); so each rank
    receives ``1/dp`` of the batch instead of all of it. The rows are the same tensors the
    broadcast-then-slice path gives (token ids travel as int32 and come back as int64). A
    ``None`` batch (every group filtered out) arrives as ``None`` everywhere. ``balance`` (a
    token budget is set): each global mini-batch's rows are spread over DP ranks by token count
    (:func:`megatron_rl.actor.micro_batches.balanced_dp_rows`) and every row carries its step
    index as ``row_index`` (the loss's global sequence index).
    """
    from megatron_rl.parallel.runtime import host_group
    from megatron_rl.rollout.collect import dp_rows

    group, rank = host_group(), dist.get_rank()
    if rank == 0:
        shares: list[dict | None] = [None] * dp
        if batch is not None:
            n = batch["tokens"].shape[0]
            if balance:
                from megatron_rl.actor.micro_batches import balanced_dp_rows, row_lengths

                batch = {**batch, "row_index": torch.arange(n)}
                lengths = row_lengths(batch["mask"])
                picks = [balanced_dp_rows(lengths, dp, d, mini) for d in range(dp)]
            else:
                picks = [dp_rows(n, dp, d, mini) for d in range(dp)]
            shares = [{k: v[p] for k, v in batch.items()} for p in picks]
        blobs: dict[int, torch.Tensor] = {}
        works = []
        for dst in range(1, len(table)):
            d = table[dst]
            if d not in blobs:
                obj = (None if shares[d] is None else _pack(shares[d]), metrics)
                blobs[d] = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)),
                                            dtype=torch.uint8)
            size = torch.tensor([blobs[d].numel()], dtype=torch.int64)
            works += [dist.isend(size, dst=dst, group=group),
                      dist.isend(blobs[d], dst=dst, group=group)]
        for w in works:
            w.wait()
        return shares[table[0]], metrics, 0
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=0, group=group)
    blob = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(blob, src=0, group=group)
    rows, metrics = pickle.loads(blob.numpy().tobytes())
    return (None if rows is None else _unpack(rows)), metrics, size.numel() * 8 + blob.numel()


class RolloutDriver:
    """Prompts, engine, tracker and early stopper, held by rank 0 (``None`` parts elsewhere)."""

    def __init__(self, cfg: RunConfig, tokenizer, score_fn) -> None:
        from megatron_rl.data.prompts import PromptLoader
        from megatron_rl.run.early_stop import EarlyStopper
        from megatron_rl.run.setup import build_datasets

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
        self.eval_sets: list = []  # data.eval_sets (rank 0): megatron_rl.eval.sets.EvalSet
        if self.rank0 and cfg.data.eval_sets:
            from megatron_rl.eval.sets import build_eval_sets

            self.eval_sets = build_eval_sets(cfg, tokenizer)
        self.eval_step: int | None = None  # the step data.eval_sets were last evaluated after
        self.stopper = EarlyStopper(**_early_stop_kwargs(cfg))
        self.engine = self.tracker = None
        self.history: list[dict] = []
        self.val_start: float | None = None
        self._dp_table: list[int] | None = None
        self.received_bytes = 0  # the last step's rows, as this rank received them
        self._collapse_records: list[dict] | None = None  # trainer.collapse_metrics (rank 0)
        self.producer = None  # rollout.max_staleness > 0: the rollout producer thread (rank 0)
        self._loader_state: dict | None = None  # loader after the last batch trained (async)
        self.bank = None  # rollout.durable_bank (rank 0): rollout.bank.RolloutBank
        self._last_saved_step: int | None = None  # next_step of the previous checkpoint
        self.teacher = None  # teacher.engine: sglang (rank 0): rollout.teacher_client
        if self.rank0:
            from megatron_rl.config.teacher import served_teacher

            if served_teacher(cfg.teacher):
                from megatron_rl.rollout.teacher_client import SGLangTeacher

                self.teacher = SGLangTeacher(cfg.teacher.url, cfg.rollout.sglang.concurrency)

    def start(self, make_engine, start_step: int, resuming: bool,
              restarted: bool = False) -> None:
        """Create the engine and the metrics tracker (rank 0). ``metrics.jsonl`` keeps the rows
        up to ``start_step`` when ``resuming``, none when ``restarted`` (an in-job restart) found
        no checkpoint: the restarted ranks log every step again."""
        from megatron_rl.metrics.step import PROGRESS_KEYS
        from megatron_rl.metrics.tracking import Tracker

        if not self.rank0:
            return
        t, lg = self.cfg.trainer, self.cfg.logging
        self.open_bank(start_step if resuming else None)
        self.engine = make_engine(self.cfg, self.tok)
        self.tracker = Tracker(t.output_dir, total_steps=t.total_steps,
                               use_tensorboard=lg.tensorboard, use_wandb=lg.wandb,
                               project=lg.project, config=self.cfg.to_dict(),
                               resume_step=start_step if resuming
                               else (-1 if restarted else None),
                               progress_keys=PROGRESS_KEYS)

    def open_bank(self, resume_step: int | None) -> None:
        """``rollout.durable_bank`` (rank 0): open ``OUTPUT_DIR/rollout_bank.bin``, keeping
        the groups a run resumed at ``resume_step`` may train on (None: a fresh run, the bank
        starts empty)."""
        import os

        from megatron_rl.rollout.bank import FILE_NAME, RolloutBank, fingerprint

        if not self.cfg.rollout.durable_bank:
            return
        self.bank = RolloutBank(os.path.join(self.cfg.trainer.output_dir, FILE_NAME),
                                fingerprint(self.cfg))
        st = self.bank.open(resume_step, self.cfg.rollout.max_staleness)
        if resume_step is not None:
            torn = f"; a torn last record ({st['torn_bytes']} bytes) cut off" \
                if st["torn_bytes"] else ""
            print(f"[train] rollout bank: {st['kept']} banked group(s) reusable from step "
                  f"{resume_step + 1}, {st['dropped']} dropped{torn}", flush=True)

    # ---- rollout ------------------------------------------------------------------------------
    def start_async(self, start_step: int, version: int) -> None:
        """``rollout.max_staleness > 0``: start the producer thread (rank 0), generating from
        batch ``start_step`` on; the engine holds ``version``
        (:mod:`megatron_rl.rollout.async_rollout`)."""
        import copy

        from megatron_rl.rollout.async_rollout import AsyncProducer
        from megatron_rl.rollout.collect import collect_step

        k = self.cfg.rollout.max_staleness
        if not self.rank0 or k == 0:
            return
        self._loader_state = copy.deepcopy(self.loader.state_dict())
        self.producer = AsyncProducer(
            lambda j: collect_step(self.engine, self.tok, self.loader, self.cfg, self.score_fn,
                                   j, self.bank),
            lambda: copy.deepcopy(self.loader.state_dict()), start_step,
            self.cfg.trainer.total_steps, k, version, self.engine)

    def published(self, version: int) -> None:
        """The engine holds ``version`` now (after a weight sync): the producer may go on."""
        if self.producer is not None:
            self.producer.published(version)

    def _take_async(self, step: int) -> tuple[list[dict], dict]:
        """Batch ``step`` from the producer, stale groups dropped; its records and metrics.
        The lengths of the responses trained on go to ``response_lengths.json`` (as on the
        synchronous path); a batch left short by stale groups is reported."""
        from megatron_rl.rollout.async_rollout import filter_stale

        item, qm = self.producer.take(step)
        records, sm = filter_stale(item.records, step, self.cfg.rollout.max_staleness)
        self._record_lengths(records)
        self._loader_state = item.loader_state
        dropped = int(sm["rollout/dropped_stale_groups"])
        if dropped:
            kept = len({r["uid"] for r in records})
            print(f"[train] step {step + 1}: {dropped} stale group(s) dropped; training on "
                  f"{kept} prompt(s) (trainer.train_batch_size="
                  f"{self.cfg.trainer.train_batch_size})", flush=True)
        return records, {**item.metrics, **qm, **sm}

    def collect(self, step: int, rows_multiple: int, dp: int, mini: int
                ) -> tuple[dict | None, dict]:
        """Generate, score and filter one step's responses; this rank's data-parallel rows of
        the padded batch on every rank (host tensors; None everywhere when every group was
        filtered out) and the rollout metrics (:func:`scatter_rows`). With asynchronous
        rollouts rank 0 takes the step's batch from the producer instead of generating it."""
        from megatron_rl.rollout.collect import collect_step, records_to_batch

        batch = metrics = None
        if self.producer is not None:
            from megatron_rl.rollout.async_rollout import token_staleness

            records, metrics = self._take_async(step)
            if records:
                batch = records_to_batch(records, self.cfg.trainer.advantage, self.tok.pad_id,
                                         rows_multiple, versions=True)
                # rank 0 reads the per-token versions; the ranks never do: not sent to them
                metrics.update(token_staleness(batch.pop("rollout_version"), batch["mask"],
                                               step))
        elif self.rank0 and self.cfg.env.name:
            from megatron_rl.rollout.multiturn import collect_env_step, episodes_to_batch

            records, metrics = collect_env_step(self.engine, self.tok, self.loader, self.cfg, step)
            self._collapse_records = records if self.collapse_due(step) else None
            if records:
                batch = episodes_to_batch(records, self.cfg.trainer.advantage, self.tok.pad_id,
                                          rows_multiple)
        elif self.rank0:
            records, metrics = collect_step(self.engine, self.tok, self.loader, self.cfg,
                                            self.score_fn, step, self.bank)
            self._record_lengths(records)
            if records:
                batch = records_to_batch(records, self.cfg.trainer.advantage, self.tok.pad_id,
                                         rows_multiple)
        if batch is not None and self.teacher is not None:  # teacher.engine: sglang
            metrics = {**metrics, **self._score_with_teacher(batch)}
        if self._dp_table is None:
            self._dp_table = dp_rank_table()
        local, metrics, self.received_bytes = scatter_rows(
            batch, metrics, self._dp_table, dp, mini,
            balance=bool(self.cfg.actor.max_tokens_per_micro_batch))
        return local, metrics

    def collapse_due(self, step: int) -> bool:
        """Whether step ``step`` logs the collapse diagnostics (``trainer.collapse_metrics``: the
        first step of the run and every ``every_n_steps``-th)."""
        c = self.cfg.trainer.collapse_metrics
        return bool(c.enabled and self.cfg.env.name and step % c.every_n_steps == 0)

    def collapse_rows(self, dp: int) -> tuple[dict | None, Any]:
        """Every rank, on a step :meth:`collapse_due`: this rank's DP share of the step's
        cross-scoring rows and their plan (:mod:`megatron_rl.metrics.collapse`), built by rank 0
        from the episodes :meth:`collect` kept."""
        from megatron_rl.metrics.collapse import build_cross_batch

        batch = plan = None
        if self.rank0 and self._collapse_records:
            rows_multiple = dp * (self.cfg.actor.micro_batch_size or 1)
            batch, plan = build_cross_batch(self._collapse_records, self.tok,
                                            self.cfg.trainer.collapse_metrics, rows_multiple)
            self._collapse_records = None
        if self._dp_table is None:
            self._dp_table = dp_rank_table()
        local, plan, _ = scatter_rows(batch, plan, self._dp_table, dp, 0)
        return local, plan

    def _score_with_teacher(self, batch: dict) -> dict[str, float]:
        """Rank 0, ``teacher.engine: sglang``: the served teacher's log-probs of the step's
        tokens as ``batch["teacher_logp"]`` ``[N, S]`` (scattered with the rows); its wall
        time as ``time/teacher``."""
        import time

        t0 = time.perf_counter()
        batch["teacher_logp"] = self.teacher.batch_logprobs(batch["tokens"], batch["mask"])
        return {"time/teacher": time.perf_counter() - t0}

    def _record_lengths(self, records: list[dict]) -> None:
        """Add the step's response lengths to ``OUTPUT_DIR/response_lengths.json`` (the
        histogram ``plan --lengths-file`` prices padding from)."""
        import os

        from megatron_rl.metrics.response_lengths import write_histogram

        if records and os.path.isdir(self.cfg.trainer.output_dir):
            write_histogram(self.cfg.trainer.output_dir,
                            [len(x["response_ids"]) for x in records],
                            self.cfg.rollout.max_new_tokens)

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
                                greedy=r.val_temperature == 0, validation=True)
        recs = generate_records(self.engine, self.tok, self.val_rows, params, self.score_fn,
                                seed=self.cfg.trainer.seed)
        return sum(x["acc"] for x in recs) / max(1, len(recs))

    def evaluate_sets(self, step: int) -> dict[str, float]:
        """``data.eval_sets`` on rank 0 through the rollout engine: ``{"eval/<set>/pass@k", ...}``
        (empty without sets and on other ranks). ``step``: RL steps done (for the log line)."""
        if self.engine is None or not self.eval_sets:
            return {}
        from megatron_rl.eval.sets import evaluate_set, logged_metrics

        results = [evaluate_set(self.engine, self.tok, es, seed=self.cfg.trainer.seed,
                                timeout_s=self.cfg.rollout.reward_timeout_s)  # as `eval` does
                   for es in self.eval_sets]
        self.eval_step = step
        for r in results:
            shown = " ".join(f"{k}={v:.3f}" for k, v in r.metrics.items() if "@" in k)
            print(f"[eval] step {step} {r.name}: {shown}", flush=True)
        return logged_metrics(results)

    def validate_start(self) -> float | None:
        """Validation (and ``data.eval_sets``) right after the warm start (once per run, kept
        across resumes)."""
        if self.val_start is None:
            self.val_start = self.validate()
            if self.rank0:
                self.tracker.log({"val/acc": self.val_start, **self.evaluate_sets(0)}, step=0)
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
                                 if k in ("val/acc", "rollout/acc", "distill/reverse_kl")})
            self.tracker.log(metrics, step=step + 1)
        return broadcast_object(decision)

    # ---- checkpointed state --------------------------------------------------------------------
    def state_dict(self, next_step: int) -> dict:
        """The trainer's part of a checkpoint (the same object on every rank)."""
        state = {"next_step": next_step, "history": self.history, "val_start": self.val_start,
                 "early_stop": self.stopper.state_dict() if self.rank0 else None,
                 "loader": self._loader_now() if self.rank0 else None}
        if self.bank is not None:  # groups before the previous checkpoint are never reused
            if self._last_saved_step is not None:
                self.bank.prune(self._last_saved_step)
            self._last_saved_step = next_step
        return broadcast_object(state)

    def _loader_now(self) -> dict:
        """The loader's state after the last batch trained (async: not the producer's, which
        is ahead; the queued batches are regenerated on resume)."""
        return self._loader_state if self.producer is not None else self.loader.state_dict()

    def stop_async(self) -> None:
        """Stop the producer (end of run or early stop): in-flight requests aborted, queued
        batches abandoned, never trained."""
        if self.producer is not None:
            n = self.producer.close()
            self.producer = None
            print(f"[train] rollout producer stopped; {n} queued batch(es) abandoned",
                  flush=True)

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
        self.stop_async()
        if val_acc is None:
            val_acc = self.validate()
        if self.eval_sets and self.eval_step != steps:  # early stop between evaluations
            self.tracker.log(self.evaluate_sets(steps), step=steps)
        summary = {"val_acc_start": self.val_start, "val_acc_end": val_acc, "wall_s": wall_s,
                   "steps": steps, **distill_summary(self.history)}
        self.tracker.close()
        getattr(self.engine, "close", lambda: None)()  # an SGLang fleet stops its processes
        if self.cfg.trainer.plots:
            try:
                from megatron_rl.metrics.plot import plot_run
                plot_run(self.cfg.trainer.output_dir)
            except Exception as exc:  # noqa: BLE001 - plotting never fails a finished run
                print(f"[train] plotting skipped: {exc}", flush=True)
        print(summary_line(summary), flush=True)
        return summary


def summary_line(summary: dict) -> str:
    """The run's last line: ``summary: val_acc_start=… val_acc_end=… wall_s=…`` (plus
    ``reverse_kl_start``/``reverse_kl_end`` for on-policy distillation runs)."""
    kl = "".join(f" {k}={summary[k]:.4f}" for k in ("reverse_kl_start", "reverse_kl_end")
                 if k in summary)
    return (f"summary: val_acc_start={summary['val_acc_start']:.4f} "
            f"val_acc_end={summary['val_acc_end']:.4f} wall_s={summary['wall_s']:.1f}{kl}")


def distill_summary(history: list[dict], window: int = 5) -> dict[str, float]:
    """``reverse_kl_start``/``reverse_kl_end`` of a distillation run: the mean
    ``distill/reverse_kl`` of the first and of the last ``window`` trained steps (``{}`` without
    a teacher)."""
    kl = [h["distill/reverse_kl"] for h in history if "distill/reverse_kl" in h]
    if not kl:
        return {}
    return {"reverse_kl_start": sum(kl[:window]) / len(kl[:window]),
            "reverse_kl_end": sum(kl[-window:]) / len(kl[-window:])}


def _early_stop_kwargs(cfg: RunConfig) -> dict:
    e = cfg.early_stop
    return {"enabled": e.enabled, "rv_baseline_steps": e.rv_warmup_steps,
            "rv_patience": e.rv_patience, "rv_ratio": e.rv_ratio,
            "val_threshold": e.val_threshold, "val_patience": e.val_patience}
