"""Spawn a local group of torch.distributed worker processes (gloo on CPU).

Used by the ``check`` command, the tests and the benchmarks. Every worker gets the torchrun
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
so the code it runs is the same code that runs under ``torchrun`` or SLURM.

Results travel back as ``torch.save`` bytes; a failure on any rank is re-raised in the parent with
that rank's traceback, and a group that does not finish within ``timeout_s`` is killed (no orphaned
workers, no hung test).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import signal
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker process raised; the message holds its rank and traceback."""


def free_port() -> int:
    """Return a TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple,
            out: Any) -> None:
    # Own process group, so the parent can kill anything this rank starts (e.g. the
    # multiprocessing manager of dist_checkpointing) when the group fails or hangs.
    os.setpgid(0, 0)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    torch.set_num_threads(max(1, int(env.get("MRL_THREADS_PER_RANK", "1"))))
    # megatron-core warns on import that apex/Transformer Engine are absent: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        result = fn(*args)
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def spawn(fn: Callable, world_size: int, args: Sequence = (), timeout_s: float = 600.0,
          env: dict | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return the per-rank results.

    ``fn`` must be importable (module level). It should call
    :func:`megatron_rl.parallel.runtime.init_distributed` itself, which reads the environment this
    launcher sets. Raises :class:`WorkerError` if any rank fails and :class:`TimeoutError` if the
    group does not finish in ``timeout_s`` seconds; in both cases every worker is terminated.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, dict(env or {}), fn,
                                                tuple(args), out), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{world_size}-process group did not finish within {timeout_s:.0f}s "
                    f"(finished ranks: {sorted(results)}, failed ranks: {sorted(errors)})")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                if dead:
                    # Give the dead rank's queue message a moment to arrive, then give up.
                    time.sleep(0.5)
                    if out.empty():
                        raise WorkerError(f"rank(s) {dead} died with exit codes "
                                          f"{[procs[r].exitcode for r in dead]} and no "
                                          "report") from None
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                # One failed rank usually leaves its peers blocked in a collective: give them
                # a short grace period to fail on their own, then stop waiting.
                deadline = min(deadline, time.monotonic() + 20.0)
        if errors:
            first = min(errors)
            raise WorkerError(f"rank {first} of {world_size} failed:\n{errors[first]}")
        return [results[r] for r in range(world_size)]
    except TimeoutError:
        if errors:
            first = min(errors)
            raise WorkerError(f"rank {first} of {world_size} failed (others then hung):\n"
                              f"{errors[first]}") from None
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for p in procs:
            _kill_group(p.pid)


def _kill_group(pgid: int | None) -> None:
    """Kill what is left of a worker's process group (its orphaned children)."""
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
