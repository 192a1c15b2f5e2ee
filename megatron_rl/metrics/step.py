"""Per-step bookkeeping shared by all ranks: phase timers, the update's metrics brought from the
last pipeline stage, and the entropy measured for adaptive entropy control."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_rl.testing.chaos_hook import phase_begins

PROGRESS_KEYS = {"reward": ("rollout/reward",), "acc": ("rollout/acc",),
                 "entropy": ("policy/entropy",)}


class Phases:
    """Wall time per phase of one step: ``with phases("rollout"): ...`` -> ``time/rollout``.

    On CUDA the device is synchronised at both ends of a phase (``sync``, default: when CUDA is
    initialised), so the kernels a phase queued count in that phase, not in the next one. Once
    per phase: a handful of syncs per step. With ``step`` given, each phase's start is also a
    fault-injection marker (:func:`megatron_rl.testing.chaos_hook.phase_begins`, inert unless
    enabled)."""

    def __init__(self, step: int | None = None, sync: bool | None = None) -> None:
        self.times: dict[str, float] = {}
        self.step = step
        self.sync = torch.cuda.is_available() and torch.cuda.is_initialized() if sync is None \
            else sync

    def _wait(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.step is not None:
            phase_begins(name, self.step)
        self._wait()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self.times[f"time/{name}"] = time.perf_counter() - t0


def last_stage_metrics(history: list[dict], src: int) -> dict:
    """The update's metrics live on the last stage (global rank ``src``); bring the last entry
    of ``history`` to every rank (the trainer passes the step's aggregate over all mini-batches
    and epochs, :func:`megatron_rl.metrics.update.aggregate_updates`)."""
    from megatron_rl.parallel.runtime import broadcast_object

    last = history[-1] if history else {}
    return dict(broadcast_object(last if dist.get_rank() == src else None, src) or {})


def measured_entropy(local: dict) -> float:
    """-mean(old_logp) over the step's valid tokens, all DP ranks (ALGORITHMS.md §10.1)."""
    from megatron.core import parallel_state as ps

    m = local["mask"]  # on the actor's device (the trainer moved the batch there)
    sums = torch.stack([(-(local["old_logp"] * m).sum()).double(), m.sum().double()])
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return float(sums[0] / sums[1].clamp_min(1))
