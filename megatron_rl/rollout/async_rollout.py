"""Asynchronous rollouts (``rollout.max_staleness: K > 0``): a producer thread on the engine's
rank generates the batches of the next steps while the actor trains on the current one.

Policy versions count RL steps, not optimizer steps: version ``v`` is the weights after ``v``
RL steps (one RL step may take several optimizer steps: ``actor.mini_batch_size``,
``actor.ppo_epochs``); step ``s`` trains with version ``s`` and then syncs version ``s + 1``
into the engine (a skipped step syncs the same weights under the next number). The producer
starts batch ``j`` only once the engine holds version ``>= j - K`` (so at most ``K + 1``
batches are ahead of the trainer), and a sample whose oldest token came from version ``v`` may
be trained on at step ``s`` only if ``s - v <= K``; older groups are dropped whole and counted
(``rollout/dropped_stale``, ``rollout/dropped_stale_groups``), never trained on silently: a
batch that dynamic sampling filled to ``trainer.train_batch_size`` prompts is then short by
those groups, and the trainer prints so.

Why a thread: generation is I/O for an SGLang fleet (HTTP requests; the GIL is released while
waiting) and torch kernels for the embedded engine (torch releases the GIL inside its ops; the
engine's lock lets a weight update in between two decode steps with ``rollout.partial``, else
at the end of the running ``generate`` call). The two
sides share the process's CPU threads: on a small CPU box generation and training compete.

The producer draws prompts in step order with the same per-step seeds as the synchronous loop,
and records the prompt loader's state after each batch: a checkpoint saved after step ``s``
stores the loader state after batch ``s`` (not the producer's), so a resume regenerates the
batches that were queued and never trains a sample twice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Produced:
    """One step's rollout from the producer: ``records`` (with per-sample ``weight_version``),
    its rollout ``metrics`` and the prompt loader's state after it."""

    step: int
    records: list[dict]
    metrics: dict
    loader_state: dict | None
    gen_s: float = 0.0
    gate_wait_s: float = 0.0
    error: BaseException | None = None


def sample_version(rec: dict) -> int:
    """The oldest policy version that produced a record's tokens (``token_versions`` when the
    engine reported per-token versions, else ``weight_version``; -1 when unknown).

    A sample that mixes versions (a partial rollout continued across a weight sync) is as old
    as its oldest token for the staleness gate, as AReaL counts a trajectory from the version
    that started it (``rollout.max_head_offpolicyness``; its tokens keep their own ``versions``)
    and verl's fully-async partial rollouts gate on ``param_version_start``. The correction
    needs nothing more: every token carries the behaviour log-prob of the version that produced
    it (``rollout_logp``), so ``rho_t = pi_old / mu_{v(t)}`` is per token and each TIS / MIS /
    IcePop weight, and seq-mask-TIS's geometric mean, reads each token against its own version
    (AReaL's ``ppo_actor_loss_fn`` behaviour weight ``exp(prox_logp - old_logp)`` per token; verl
    ``compute_rollout_correction_weights`` on ``rollout_log_probs``)."""
    tv = rec.get("token_versions")
    if tv:
        return int(min(tv))
    return int(rec.get("weight_version", -1))


def filter_stale(records: list[dict], step: int, max_staleness: int
                 ) -> tuple[list[dict], dict[str, float]]:
    """Keep the groups (``uid``) all of whose samples satisfy ``step - version <= K``.

    Returns ``(kept records, metrics)``: ``rollout/staleness_mean`` / ``staleness_max`` over the
    samples generated (staleness ``step - version``; a version of -1, unknown, counts as 0),
    ``rollout/dropped_stale`` (samples dropped, whole groups) and ``rollout/dropped_stale_groups``
    (the groups, i.e. prompts, dropped)."""
    stale = {r["uid"] for r in records if step - sample_version(r) > max_staleness
             and sample_version(r) >= 0}
    kept = [r for r in records if r["uid"] not in stale]
    lags = [max(0, step - sample_version(r)) if sample_version(r) >= 0 else 0 for r in records]
    return kept, {"rollout/staleness_mean": sum(lags) / max(1, len(lags)),
                  "rollout/staleness_max": float(max(lags, default=0)),
                  "rollout/dropped_stale": float(len(records) - len(kept)),
                  "rollout/dropped_stale_groups": float(len(stale)),
                  **partial_sample_metrics(kept)}


def token_staleness(versions: torch.Tensor, mask: torch.Tensor, step: int) -> dict[str, float]:
    """``rollout/token_staleness_mean`` / ``_max``: ``step - v`` over the valid response tokens
    of a step batch (``versions [N, S]`` int64 of :func:`~megatron_rl.rollout.collect.
    records_to_batch`, ``mask [N, S]`` bool, host tensors); a token of unknown version (-1)
    counts as 0. With partial rollouts a response's tokens come from several versions, so this
    differs from ``rollout/staleness_mean`` (per sample, its oldest token)."""
    valid = mask.bool() & (versions >= 0)
    lag = torch.where(valid, (step - versions).clamp_min(0), 0)
    n = int(mask.bool().sum())
    return {"rollout/token_staleness_mean": float(lag.sum()) / max(1, n),
            "rollout/token_staleness_max": float(lag.max()) if lag.numel() else 0.0}


def partial_sample_metrics(records: list[dict]) -> dict[str, float]:
    """``rollout/partial_samples``: kept samples whose tokens came from more than one version
    (they ran across a weight sync; per-token staleness: :func:`token_staleness`)."""
    partial = sum(len(set(r.get("token_versions") or [])) > 1 for r in records)
    return {"rollout/partial_samples": float(partial)}


class AsyncProducer:
    """The producer thread. ``produce(step) -> (records, metrics)`` runs in it; ``loader_state()``
    snapshots the prompt loader after each batch. The trainer calls :meth:`published` after
    every weight sync and :meth:`take` once per step."""

    def __init__(self, produce: Callable[[int], tuple[list[dict], dict]],
                 loader_state: Callable[[], dict | None], start: int, stop: int,
                 max_staleness: int, version: int, engine=None) -> None:
        self.produce, self.loader_state = produce, loader_state
        self.k, self.next, self.end = max_staleness, start, stop
        self.version = version  # the version the engine holds
        self.engine = engine  # an SGLang engine's in-flight requests are aborted at close
        self.cond = threading.Condition()
        self.ready: dict[int, Produced] = {}
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for j in range(self.next, self.end):
            t0 = time.perf_counter()
            with self.cond:  # gate: batch j needs version >= j - K in the engine
                while not self.closing and self.version < j - self.k:
                    self.cond.wait()
                if self.closing:
                    return
            waited = time.perf_counter() - t0
            t1 = time.perf_counter()
            try:
                records, metrics = self.produce(j)
                item = Produced(j, records, metrics, self.loader_state(),
                                time.perf_counter() - t1, waited)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the trainer's thread
                item = Produced(j, [], {}, None, error=exc)
            with self.cond:
                if self.closing:
                    return
                self.ready[j] = item
                self.cond.notify_all()
            if item.error is not None:
                return

    def published(self, version: int) -> None:
        """The engine now holds ``version`` (after a weight sync)."""
        with self.cond:
            self.version = max(self.version, version)
            self.cond.notify_all()

    def take(self, step: int) -> tuple[Produced, dict[str, float]]:
        """Block until batch ``step`` is ready; it and the queue metrics (``rollout/
        queue_depth`` batches ready when asked, ``rollout/trainer_wait_s``, ``rollout/
        producer_wait_s`` spent by the producer at its staleness gate, ``rollout/gen_s``)."""
        t0 = time.perf_counter()
        with self.cond:
            depth = len(self.ready)
            while step not in self.ready:
                if not self.thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before batch {step}")
                self.cond.wait(timeout=1.0)
            item = self.ready.pop(step)
        if item.error is not None:
            raise item.error
        return item, {"rollout/queue_depth": float(depth),
                      "rollout/trainer_wait_s": time.perf_counter() - t0,
                      "rollout/producer_wait_s": item.gate_wait_s, "rollout/gen_s": item.gen_s}

    def close(self, timeout_s: float = 120.0) -> int:
        """Stop producing (an early stop or the end): in-flight requests are aborted, queued
        batches abandoned (never trained). Returns the number of batches abandoned."""
        with self.cond:
            self.closing = True
            abandoned = len(self.ready)
            self.ready.clear()
            self.cond.notify_all()
        cancel = getattr(self.engine, "cancel_all", None)
        if cancel is not None and self.thread.is_alive():
            cancel(True)
        self.thread.join(timeout_s)
        if cancel is not None:
            cancel(False)
        return abandoned
